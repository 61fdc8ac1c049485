"""UI→API conversion with fixture node definitions (captured from ComfyUI 0.3.64), and --set."""
import copy
import json
from pathlib import Path

import pytest

from sdopt.errors import UserError
from sdopt.tools.workflow import (
    apply_overrides,
    is_api_format,
    is_ui_format,
    load_workflow,
    parse_override,
    ui_to_api,
    validation_message,
    widget_names,
)

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = Path(__file__).parent / "fixtures"
BASELINE = ROOT / "workflows" / "sd15_baseline.json"


@pytest.fixture(scope="module")
def definitions():
    return json.loads((FIXTURES / "object_info.json").read_text())


@pytest.fixture()
def baseline():
    return load_workflow(BASELINE)


def test_widget_names_follow_input_order_and_skip_sockets(definitions):
    assert widget_names(definitions["KSampler"]) == ["seed", "steps", "cfg", "sampler_name", "scheduler", "denoise"]
    assert widget_names(definitions["SDOptProfileReport"]) == ["filename_prefix"]


def test_baseline_converts_to_the_api_prompt(baseline, definitions):
    assert is_ui_format(baseline) and not is_api_format(baseline)
    prompt = ui_to_api(baseline, definitions)
    assert is_api_format(prompt)
    assert {n["class_type"] for n in prompt.values()} == {
        "CheckpointLoaderSimple",
        "SDOptProfiler",
        "CLIPTextEncode",
        "EmptyLatentImage",
        "KSampler",
        "VAEDecode",
        "SaveImage",
        "SDOptProfileReport",
    }, "the Note node must not reach the server"
    ksampler = prompt["3"]["inputs"]
    # The "fixed" seed-control value after the seed is skipped, so steps gets 20, not "fixed".
    assert ksampler == {
        "seed": 42,
        "steps": 20,
        "cfg": 7.0,
        "sampler_name": "euler",
        "scheduler": "normal",
        "denoise": 1.0,
        "model": ["10", 0],
        "positive": ["6", 0],
        "negative": ["7", 0],
        "latent_image": ["5", 0],
    }
    assert prompt["10"]["inputs"] == {"label": "baseline", "model": ["4", 0]}
    assert prompt["8"]["inputs"] == {"samples": ["3", 0], "vae": ["4", 2]}
    assert prompt["11"]["inputs"] == {"filename_prefix": "sdopt/profile", "images": ["8", 0]}
    assert prompt["6"]["_meta"]["title"] == "Positive prompt"


def _add_node(workflow, node_id, node_type, inputs=(), widgets=(), mode=0):
    workflow["nodes"].append(
        {
            "id": node_id,
            "type": node_type,
            "mode": mode,
            "inputs": [{"name": n, "type": t, "link": link} for n, t, link in inputs],
            "outputs": [],
            "widgets_values": list(widgets),
        }
    )


def _relink(workflow, link_id, source, slot, target, target_slot, link_type):
    workflow["links"] = [l for l in workflow["links"] if l[0] != link_id]
    workflow["links"].append([link_id, source, slot, target, target_slot, link_type])
    for node in workflow["nodes"]:
        if node["id"] == target:
            node["inputs"][target_slot]["link"] = link_id


def test_reroute_is_followed(baseline, definitions):
    _add_node(baseline, 50, "Reroute", inputs=[("", "*", 100)])
    baseline["links"].append([100, 4, 2, 50, 0, "VAE"])
    _relink(baseline, 9, 50, 0, 8, 1, "VAE")
    assert ui_to_api(baseline, definitions)["8"]["inputs"]["vae"] == ["4", 2]


def test_bypassed_node_passes_its_input_through(baseline, definitions):
    profiler = next(n for n in baseline["nodes"] if n["id"] == 10)
    profiler["mode"] = 4
    prompt = ui_to_api(baseline, definitions)
    assert "10" not in prompt
    assert prompt["3"]["inputs"]["model"] == ["4", 0]


def test_muted_node_is_dropped_with_its_links(baseline, definitions):
    next(n for n in baseline["nodes"] if n["id"] == 9)["mode"] = 2
    prompt = ui_to_api(baseline, definitions)
    assert "9" not in prompt


def test_primitive_value_replaces_the_widget(baseline, definitions):
    _add_node(baseline, 60, "PrimitiveNode", widgets=[7, "fixed"])
    ksampler = next(n for n in baseline["nodes"] if n["id"] == 3)
    ksampler["inputs"].append({"name": "steps", "type": "INT", "link": 200, "widget": {"name": "steps"}})
    baseline["links"].append([200, 60, 0, 3, 4, "INT"])
    assert ui_to_api(baseline, definitions)["3"]["inputs"]["steps"] == 7


def test_unknown_node_type_is_one_line(baseline, definitions):
    _add_node(baseline, 70, "FancyUpscaler")
    with pytest.raises(UserError, match=r"unknown node type FancyUpscaler: install the custom node pack") as error:
        ui_to_api(baseline, definitions)
    assert "\n" not in str(error.value)


def test_overrides_match_class_and_title(baseline, definitions):
    prompt = ui_to_api(baseline, definitions)
    apply_overrides(prompt, ["KSampler.steps=2", "EmptyLatentImage.width=128", "Negative prompt.text=ugly"], definitions)
    assert prompt["3"]["inputs"]["steps"] == 2
    assert prompt["5"]["inputs"]["width"] == 128
    assert prompt["7"]["inputs"]["text"] == "ugly"
    assert prompt["6"]["inputs"]["text"] != "ugly"
    apply_overrides(prompt, ["CLIPTextEncode.text=same for both"], definitions)
    assert prompt["6"]["inputs"]["text"] == prompt["7"]["inputs"]["text"] == "same for both"


@pytest.mark.parametrize(
    "text,value",
    [("A.b=2", 2), ("A.b=0.5", 0.5), ("A.b=true", True), ("A.b=euler", "euler"), ("My node.x=a=b", "a=b")],
)
def test_override_values_are_json_or_text(text, value):
    assert parse_override(text)[2] == value


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("KSamplr.steps=2", r"matches no node: no node has class or title 'KSamplr'"),
        ("KSampler.stepz=2", r"KSampler has no input 'stepz'"),
        ("steps=2", r"is not CLASS_OR_TITLE.INPUT=VALUE"),
        ("KSampler.steps", r"is not CLASS_OR_TITLE.INPUT=VALUE"),
    ],
)
def test_bad_overrides_are_one_line_errors(baseline, definitions, override, pattern):
    prompt = ui_to_api(baseline, definitions)
    before = copy.deepcopy(prompt)
    with pytest.raises(UserError, match=pattern) as error:
        apply_overrides(prompt, [override], definitions)
    assert "\n" not in str(error.value)
    assert prompt == before


FLAGS = {"Flags": {"input": {"required": {"dynamic": ("BOOLEAN", {"default": False}), "steps": ("INT", {"default": 20}),
                                            "cfg": ("FLOAT", {"default": 8.0}), "text": ("STRING", {"multiline": True})}}}}


def _flags(override):
    prompt = {"1": {"class_type": "Flags", "inputs": {}}}
    return apply_overrides(prompt, [override], FLAGS)["1"]["inputs"]


@pytest.mark.parametrize(
    "raw,flag",
    [("true", True), ("False", False), ("TRUE", True), ("1", True), ("0", False), ("yes", True), ("No", False),
     ("on", True), ("OFF", False), ('"false"', False)],
)
def test_boolean_overrides_become_real_booleans(raw, flag):
    assert _flags(f"Flags.dynamic={raw}")["dynamic"] is flag


@pytest.mark.parametrize(
    "override,value",
    [("Flags.steps=3", 3), ("Flags.steps=3.0", 3), ("Flags.cfg=7", 7.0), ("Flags.cfg=7.5", 7.5)],
)
def test_number_overrides_keep_their_type(override, value):
    name = override.split(".")[1].split("=")[0]
    assert _flags(override)[name] == value and type(_flags(override)[name]) is type(value)


@pytest.mark.parametrize("raw", ["true", "20", "null", '"quoted"', "a cat, 4k"])
def test_string_overrides_keep_the_text_as_written(raw):
    assert _flags(f"Flags.text={raw}")["text"] == raw


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("Flags.dynamic=maybe", r"^--set Flags.dynamic: 'maybe' is not a boolean: write true or false \(or 1/0, yes/no, on/off\)$"),
        ("Flags.dynamic=2", r"^--set Flags.dynamic: '2' is not a boolean"),
        ("Flags.dynamic=", r"^--set Flags.dynamic: '' is not a boolean"),
        ("Flags.steps=abc", r"^--set Flags.steps: 'abc' is not a whole number: write e.g. --set Flags.steps=20$"),
        ("Flags.steps=2.5", r"^--set Flags.steps: '2.5' is not a whole number"),
        ("Flags.steps=true", r"^--set Flags.steps: 'true' is not a whole number"),
        ("Flags.cfg=high", r"^--set Flags.cfg: 'high' is not a number: write e.g. --set Flags.cfg=8.0$"),
        ("Flags.cfg=NaN", r"^--set Flags.cfg: 'NaN' is not a number"),
    ],
)
def test_overrides_of_the_wrong_type_are_one_line_errors(override, pattern):
    with pytest.raises(UserError, match=pattern):
        _flags(override)


def test_ksampler_numbers_are_checked_against_its_definition(baseline, definitions):
    prompt = ui_to_api(baseline, definitions)
    with pytest.raises(UserError, match=r"^--set KSampler.steps: 'abc' is not a whole number: write e.g. --set KSampler.steps=20$"):
        apply_overrides(prompt, ["KSampler.steps=abc"], definitions)
    apply_overrides(prompt, ["KSampler.cfg=6", "KSampler.seed=7"], definitions)
    assert prompt["3"]["inputs"]["cfg"] == 6.0 and prompt["3"]["inputs"]["seed"] == 7


def test_invalid_json_names_the_position(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [,]}')
    with pytest.raises(UserError, match=r"bad.json is not valid JSON \(line 1, column 12"):
        load_workflow(bad)


def test_missing_and_foreign_files_are_rejected(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_workflow(tmp_path / "nope.json")
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(UserError, match="neither a ComfyUI UI workflow nor an API prompt"):
        load_workflow(other)


def _missing_checkpoint(filename: str) -> str:
    reason = {
        "type": "value_not_in_list",
        "message": "Value not in list",
        "details": f"ckpt_name: '{filename}' not in []",
        "extra_info": {"input_name": "ckpt_name", "received_value": filename},
    }
    return validation_message("4", "CheckpointLoaderSimple", reason, ["/comfy/models/checkpoints"])


@pytest.mark.parametrize("filename, model", [("sdopt-mini-sd15.safetensors", "mini"), ("sdopt-mini-sdxl.safetensors", "sdxl-mini"),
                                             ("sdopt-full-sdxl.safetensors", "sdxl-full")])
def test_missing_checkpoint_suggests_make_model_of_its_family(filename, model):
    message = _missing_checkpoint(filename)
    assert message.startswith(f"missing model file '{filename}'")
    assert f"python -m sdopt make-model {model} --out /comfy/models/checkpoints/{filename}" in message


def test_missing_foreign_checkpoint_lists_the_model_names():
    message = _missing_checkpoint("juggernautXL.safetensors")
    assert "make-model NAME --out /comfy/models/checkpoints/juggernautXL.safetensors" in message
    assert "sdxl-mini" in message and "make-model mini" not in message


def test_other_validation_errors_name_node_and_input():
    reason = {
        "type": "value_smaller_than_min",
        "message": "Value 0 smaller than min of 1",
        "details": "steps",
        "extra_info": {"input_name": "steps", "received_value": 0},
    }
    assert validation_message("3", "KSampler", reason, []) == "node 3 KSampler.steps: Value 0 smaller than min of 1: steps"


def _png(path, **chunks):
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for name, text in chunks.items():
        info.add_text(name, text)
    Image.new("RGB", (8, 8)).save(path, pnginfo=info)
    return path


def test_png_saved_by_comfyui_gives_its_ui_workflow(tmp_path, baseline):
    prompt = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
    png = _png(tmp_path / "shared.png", prompt=json.dumps(prompt), workflow=BASELINE.read_text())
    assert load_workflow(png) == baseline


def test_png_without_ui_workflow_gives_its_api_prompt(tmp_path):
    prompt = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
    assert load_workflow(_png(tmp_path / "api.png", prompt=json.dumps(prompt))) == prompt


def test_png_without_workflow_chunks_is_one_line(tmp_path):
    png = _png(tmp_path / "photo.png", Description="a cat")
    with pytest.raises(UserError, match=r'photo.png is a PNG without a ComfyUI workflow \(no "workflow" or "prompt"') as error:
        load_workflow(png)
    assert "\n" not in str(error.value)


def test_png_with_broken_workflow_chunk_names_the_chunk(tmp_path):
    png = _png(tmp_path / "broken.png", workflow='{"nodes": [')
    with pytest.raises(UserError, match=r'broken.png \(its "workflow" text chunk\) is not valid JSON'):
        load_workflow(png)


def test_truncated_png_is_one_line(tmp_path):
    png = _png(tmp_path / "half.png", workflow=BASELINE.read_text())
    png.write_bytes(png.read_bytes()[:20])
    with pytest.raises(UserError, match=r"half.png is a PNG that cannot be read \(.+\): save the image from ComfyUI again"):
        load_workflow(png)


def test_file_neither_json_nor_png_is_one_line(tmp_path):
    from PIL import Image

    jpeg = tmp_path / "preview.jpg"
    Image.new("RGB", (8, 8)).save(jpeg)
    with pytest.raises(UserError, match=r"preview.jpg is neither a JSON workflow nor a PNG saved by ComfyUI: export"):
        load_workflow(jpeg)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_workflow_with_a_byte_order_mark_loads(tmp_path, baseline, encoding):
    windows = tmp_path / "windows.json"
    windows.write_text(BASELINE.read_text(encoding="utf-8"), encoding=encoding)
    assert load_workflow(windows) == baseline


def test_api_link_to_a_missing_node_names_the_input(tmp_path):
    prompt = {
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["99", 2]}},
    }
    api = tmp_path / "api.json"
    api.write_text(json.dumps(prompt))
    with pytest.raises(
        UserError, match=r"^node 8 \(VAEDecode\) input vae links to node 99, which is not in the workflow: connect"
    ):
        load_workflow(api)
    del prompt["8"]["inputs"]["vae"]
    api.write_text(json.dumps(prompt))
    assert load_workflow(api) == prompt


def test_api_inputs_that_are_not_an_object_name_the_node(tmp_path):
    api = tmp_path / "api.json"
    api.write_text(json.dumps({"5": {"class_type": "EmptyLatentImage", "inputs": [64, 64, 1]}}))
    with pytest.raises(UserError, match=r'^node 5 \(EmptyLatentImage\) has inputs of type list, .*"Export \(API\)"$'):
        load_workflow(api)


def test_link_from_a_deleted_node_is_one_line(baseline, definitions):
    baseline["nodes"] = [n for n in baseline["nodes"] if n["id"] != 4]
    with pytest.raises(UserError, match=r"^link \d+ comes from node 4, which is not in the workflow: reconnect or delete"):
        ui_to_api(baseline, definitions)


def test_input_on_a_link_missing_from_links_is_one_line(baseline, definitions):
    baseline["links"] = [l for l in baseline["links"] if l[0] != 9]
    with pytest.raises(UserError, match=r"^node 8 \(VAEDecode\) is connected by link 9, which is not in the workflow's links"):
        ui_to_api(baseline, definitions)


def test_node_without_type_is_one_line(baseline, definitions):
    del next(n for n in baseline["nodes"] if n["id"] == 5)["type"]
    with pytest.raises(UserError, match=r'^node 5 has no "type" \(its node class'):
        ui_to_api(baseline, definitions)


@pytest.mark.parametrize("entry", [[9, 4, 2], {"id": 9, "origin_id": 4}, "9"])
def test_malformed_link_entry_is_one_line(baseline, definitions, entry):
    baseline["links"].append(entry)
    with pytest.raises(UserError, match=rf"^entry {len(baseline['links'])} of the workflow's links is not \[id, origin node"):
        ui_to_api(baseline, definitions)


def test_override_of_a_link_input_is_refused(baseline, definitions):
    prompt = ui_to_api(baseline, definitions)
    with pytest.raises(UserError) as error:
        apply_overrides(prompt, ["KSampler.model=foo"], definitions)
    assert str(error.value) == (
        "--set KSampler.model: model is a link (MODEL), not a widget; "
        "--set takes widget inputs (KSampler's: seed, steps, cfg, sampler_name, scheduler, denoise)"
    )
    assert prompt["3"]["inputs"]["model"] == ["10", 0]
