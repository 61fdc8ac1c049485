"""SDOptProfileReport in real ComfyUI: the report travels as one ``sdopt.report`` event, the node's
history output is the chart only, and a re-queue that ComfyUI serves from its cache shows the last
real figures, marked cached."""
import json

import pytest
from PIL import Image

NODE = "SDOptProfileReport"


@pytest.fixture(scope="module")
def queued_twice(comfy_host):
    """The baseline queued after clearing the cache, then again with nothing changed."""
    prompt = comfy_host.prompt(comfy_host.WORKFLOWS / "sd15_baseline.json", [*comfy_host.SMALL, "KSampler.steps=1"])
    comfy_host.host.clear_cache()
    real = comfy_host.host.execute(prompt)
    real_events = comfy_host.reports()
    cached = comfy_host.host.execute(prompt)
    cached_events = comfy_host.reports()
    return dict(prompt=prompt, node=comfy_host.node_id(prompt, NODE), real=real, cached=cached,
                events=(real_events, cached_events))


def test_real_run_reports_its_sampling(queued_twice):
    report = queued_twice["real"].report
    assert report.cached is False
    (run,) = report.runs
    assert run["label"] == "baseline" and len(run["steps"]) == 1
    assert not any("cached" in note for note in report.notes)


def test_rerun_with_nothing_changed_shows_the_last_real_figures_marked_cached(queued_twice):
    real, cached = queued_twice["real"].report, queued_twice["cached"].report
    assert cached.cached is True
    assert cached.runs == real.runs and cached.runs, "the same run figures as the last real run"
    assert cached.nodes == real.nodes and cached.optimizations == real.optimizations
    (note,) = cached.notes
    assert "ComfyUI reused cached results" in note and "last real figures" in note
    assert "No sampling run was profiled" not in cached.markdown()
    assert note in cached.markdown()


def test_a_cached_report_keeps_the_notes_of_the_real_one(comfy_host, monkeypatch):
    note = "dynamic VRAM turned off where ComfyUI turns it on by default"
    monkeypatch.setattr(comfy_host.pack("nodes.environment"), "memory_mode", lambda device: ("classic", note))
    prompt = comfy_host.prompt(comfy_host.WORKFLOWS / "sd15_baseline.json", [*comfy_host.SMALL, "KSampler.steps=1", "KSampler.seed=5"])
    comfy_host.host.clear_cache()
    real = comfy_host.host.execute(prompt).report
    cached = comfy_host.host.execute(prompt).report
    assert real.notes == [note]
    assert cached.cached and "last real figures" in cached.notes[0]
    assert cached.notes[1:] == [note]


def test_each_queue_saves_its_own_json(queued_twice):
    real, cached = queued_twice["real"], queued_twice["cached"]
    assert real.report_path != cached.report_path
    for outcome in (real, cached):
        assert json.loads(outcome.report_path.read_text()) == outcome.report.to_dict()
    assert json.loads(cached.report_path.read_text())["cached"] is True


def test_history_output_is_the_chart_only(queued_twice):
    for outcome in (queued_twice["real"], queued_twice["cached"]):
        output = outcome.outputs[queued_twice["node"]]
        assert set(output) == {"images"}, "no text or sdopt_report outputs: the report goes out as an event"
        (chart,) = output["images"]
        assert chart["filename"].endswith(".png") and chart["type"] == "output"
        (path,) = [p for p in outcome.images if p.name == chart["filename"]]
        assert Image.open(path).format == "PNG"


def test_one_report_event_per_queue_carries_report_table_and_files(queued_twice):
    for outcome, events in zip((queued_twice["real"], queued_twice["cached"]), queued_twice["events"]):
        (event,) = events
        assert event["node"] == queued_twice["node"]
        assert event["report"] == outcome.report.to_dict()
        assert event["table"] == outcome.report.markdown()
        assert "| baseline | 1 |" in event["table"]
        assert event["path"] == str(outcome.report_path)
        assert event["json"]["filename"] == outcome.report_path.name
        assert event["chart"] == outcome.outputs[queued_twice["node"]]["images"][0]


def test_report_needs_images_or_latent(comfy_host):
    UserError = comfy_host.pack("errors").UserError
    with pytest.raises(UserError, match=r"^images: connect 'images'"):
        comfy_host.nodes[NODE]().report("sdopt/profile")


@pytest.mark.parametrize("node, call", [
    (NODE, lambda node, prefix: node.report(prefix, latent={"samples": None})),
    ("SDOptDoctor", lambda node, prefix: node.examine(prefix)),
])
@pytest.mark.parametrize("prefix", ["../escape", "sdopt/../../escape", "/tmp/escape"])
def test_a_prefix_that_leaves_the_output_folder_is_the_inputs_error(comfy_host, node, call, prefix):
    UserError = comfy_host.pack("errors").UserError
    with pytest.raises(UserError, match=r"^filename_prefix: .* leaves ComfyUI's output folder; give a path inside it"):
        call(comfy_host.nodes[node](), prefix)


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_the_report_names_the_model_family_of_each_run(comfy_host, family):
    host = comfy_host.family(family)
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": host.checkpoint.name}},
        "2": {"class_type": "SDOptProfiler", "inputs": {"model": ["1", 0], "label": family}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a lighthouse"}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "seed": 0, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "normal",
            "positive": ["3", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": NODE, "inputs": {"filename_prefix": "sdopt/family", "latent": ["5", 0]}},
    }
    report = host.run(prompt).report
    (run,) = report.runs
    assert run["model_family"] == host.model_family.title
    (row,) = [line for line in report.markdown().splitlines() if line.startswith(f"| {family} |")]
    assert row.endswith(f" | {host.model_family.title} |")
