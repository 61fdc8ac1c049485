"""The soak's pure parts: prompts drawn from a seed (valid against the real node definitions, every node
covered), when and after what RSS is read, the drift and the verdict, the server's error replies read
into one line, the CLI's options."""
import json
import math
import threading
from pathlib import Path

import pytest

from sdopt.errors import UserError
from sdopt.nodes.registry import NODE_CLASS_MAPPINGS
from sdopt.tools.cli import build_parser, main
from sdopt.tools.soak import (
    GROUPS, LORA, PROFILER, REPORT, SOAK_NODES, SUCCESS, PromptOutcome, SoakModel, SoakResult, drift, history_error, plan_prompt,
    probe_prompt, problems, reading_points,
)
from sdopt.tools.soak import chaos, run as soak_run
from sdopt.tools.soak.server import INTERRUPTED, _rejection, ended_status, server_env

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = {"sdopt-mini-sd15.safetensors": SoakModel("sdopt-soak-mini-lora.safetensors")}
FLUX = {"sdopt-mini-flux.safetensors": SoakModel("sdopt-soak-flux-mini-lora.safetensors", "sdopt-mini-flux-text.safetensors")}


@pytest.fixture(scope="module")
def core_definitions():
    return json.loads((FIXTURES / "object_info.json").read_text())


def _check_value(where: str, spec, value) -> None:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if isinstance(kind, (list, tuple)):
        assert value in kind, f"{where}={value!r} is not one of {kind}"
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}={value!r} is not a boolean"
    elif kind in ("INT", "FLOAT"):
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), where
        assert kind == "FLOAT" or value == int(value), f"{where}={value!r} is not whole"
        assert options.get("min", -math.inf) <= value <= options.get("max", math.inf), f"{where}={value!r} is out of range {options}"
    elif kind == "STRING":
        assert isinstance(value, str) and value, where
    else:  # a link: [source id, output slot]
        assert isinstance(value, list) and len(value) == 2, f"{where} should be a link, got {value!r}"


def _validate(prompt: dict, core_definitions: dict) -> None:
    """Every node's required inputs are given and valid per its definition; every link reaches an output
    of the type the input takes."""
    outputs = {}
    for node_id, node in prompt.items():
        cls = NODE_CLASS_MAPPINGS.get(node["class_type"])
        outputs[node_id] = cls.RETURN_TYPES if cls else None
    for node_id, node in prompt.items():
        cls = NODE_CLASS_MAPPINGS.get(node["class_type"])
        if cls is not None:
            inputs = cls.INPUT_TYPES()
        elif node["class_type"] in core_definitions:
            inputs = core_definitions[node["class_type"]]["input"]
        else:
            assert node["class_type"] == LORA
            assert set(node["inputs"]) == {"model", "lora_name", "strength_model"}
            continue
        specs = {**inputs.get("required", {}), **inputs.get("optional", {})}
        assert set(inputs.get("required", {})) <= set(node["inputs"]), f"{node_id} {node['class_type']} lacks inputs"
        assert set(node["inputs"]) <= set(specs), f"{node_id} {node['class_type']} has unknown inputs"
        for name, value in node["inputs"].items():
            _check_value(f"{node['class_type']}.{name}", specs[name], value)
            if isinstance(value, list):
                assert value[0] in prompt, f"{node_id}.{name} links to a missing node {value[0]}"
                produced = outputs[value[0]]
                if produced is not None:
                    assert produced[value[1]] == specs[name][0], f"{node_id}.{name} gets {produced[value[1]]}"


def test_the_same_seed_draws_the_same_prompts_and_another_seed_others():
    first = [plan_prompt(index, 7, CHECKPOINTS) for index in range(20)]
    assert first == [plan_prompt(index, 7, CHECKPOINTS) for index in range(20)]
    assert [p.api_prompt() for p in first] == [plan_prompt(index, 7, CHECKPOINTS).api_prompt() for index in range(20)]
    other = [plan_prompt(index, 8, CHECKPOINTS) for index in range(20)]
    assert [p.describe() for p in first] != [p.describe() for p in other]
    assert len({p.describe() for p in first}) == 20


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_prompts_are_valid_api_prompts_for_the_real_node_definitions(seed, core_definitions):
    for index in range(40):
        planned = plan_prompt(index, seed, CHECKPOINTS)
        prompt = planned.api_prompt()
        _validate(prompt, core_definitions)
        chain = [link.class_type for link in planned.model_chain]
        assert PROFILER not in chain[:-1], "the Profiler goes last on the MODEL path"
        assert chain.count(LORA) <= 1 and len(chain) == len(set(chain))
        assert planned.width % 32 == 0 and planned.height % 32 == 0 and 64 <= min(planned.width, planned.height)
        assert prompt["sampler"]["inputs"]["model"] == ([f"model{len(chain) - 1}", 0] if chain else ["ckpt", 0])
        assert (REPORT in prompt.get("report", {}).get("class_type", "")) == planned.report
        for link in planned.model_chain:
            if link.class_type == "SDOptCompile":
                assert link.inputs["backend"] != "inductor" or link.inputs["mode"] == "trace"


def test_any_five_consecutive_prompts_use_every_node_and_the_lora_comes_and_goes():
    assert GROUPS == 5
    for start in (0, 3, 11):
        batch = [plan_prompt(index, 0, CHECKPOINTS) for index in range(start, start + GROUPS)]
        assert set().union(*(p.nodes() for p in batch)) >= set(SOAK_NODES)
    many = [plan_prompt(index, 0, CHECKPOINTS) for index in range(40)]
    with_lora = [any(link.class_type == LORA for link in p.model_chain) for p in many]
    assert any(with_lora) and not all(with_lora)
    no_lora = [plan_prompt(index, 0, {"sdopt-mini-sd15.safetensors": SoakModel()}) for index in range(20)]
    assert not any(link.class_type == LORA for p in no_lora for link in p.model_chain)


def test_compile_is_drawn_in_each_of_its_modes():
    from sdopt.optim.compile import MODES

    drawn = {link.inputs["mode"] for index in range(5, 60) for link in plan_prompt(index, 0, CHECKPOINTS).model_chain
             if link.class_type == "SDOptCompile"}
    assert drawn == set(MODES)


def test_the_first_warm_up_prompts_run_compile_in_each_of_its_modes():
    def modes(index, seed, warmup):
        chain = plan_prompt(index, seed, CHECKPOINTS, warmup).model_chain
        return [link.inputs["mode"] for link in chain if link.class_type == "SDOptCompile"]

    from sdopt.optim.compile import MODES

    for seed in (0, 1):
        assert [modes(index, seed, 5) for index in range(3)] == [[mode] for mode in MODES]
        assert modes(0, seed, 1) == ["compile"] and plan_prompt(1, seed, CHECKPOINTS, 1) == plan_prompt(1, seed, CHECKPOINTS, 0)
    assert plan_prompt(0, 0, CHECKPOINTS, 0) != plan_prompt(0, 0, CHECKPOINTS, 5), "no warm-up: the prompt as drawn"


def test_the_probe_prompt_is_stock_and_fixed(core_definitions):
    probe = probe_prompt("sdopt-mini-sd15.safetensors")
    _validate(probe, core_definitions)
    assert probe == probe_prompt("sdopt-mini-sd15.safetensors")
    assert not any(node["class_type"].startswith("SDOpt") for node in probe.values())


def test_drift_is_the_growth_over_the_warm_reading():
    assert drift(1000, 1050) == pytest.approx(0.05)
    assert drift(1000, 900) == pytest.approx(-0.1)
    with pytest.raises(ValueError):
        drift(0, 10)


def test_the_verdict_lists_each_failed_prompt_and_too_much_drift():
    ok = PromptOutcome(0, "chain a", SUCCESS, 1.0)
    failed = PromptOutcome(1, "chain b", "error", 2.0, "node 3 SDOptCompile: RuntimeError: boom\nTraceback ...")
    assert problems([ok], 0.05, 0.05) == []
    assert problems([ok], -0.2, 0.05) == []
    assert problems([ok], 0.0501, 0.05) == ["RSS drift +5.0% is above the 5.0% allowed"]
    assert problems([ok, failed], 0.0, 0.05) == ["prompt 1 error: node 3 SDOptCompile: RuntimeError: boom [chain b]"]
    assert problems([ok], None, 0.05) == ["no RSS reading: the soak stopped before the end reading"]
    result = SoakResult(seed=3, prompts=2, warmup=1, outcomes=[ok, failed], readings=[(1, 2**30), (2, 2**30 + 2**20)])
    assert result.failed == 1 and result.drift == pytest.approx(2**-10)
    data = result.to_dict()
    assert data["passed"] is False and data["failed"] == 1 and data["outcomes"][1]["error"].startswith("node 3")
    assert "1 failed" in result.summary() and "FAILED: prompt 1 error" in result.summary()
    assert SoakResult(seed=3, prompts=1, warmup=0, outcomes=[ok], readings=[(0, 100), (1, 100)]).summary().endswith("passed")


def test_rss_is_read_after_the_warm_up_every_ten_prompts_and_at_the_end():
    assert reading_points(100, 5) == [5, 15, 25, 35, 45, 55, 65, 75, 85, 95, 100]
    assert reading_points(5, 4) == [4, 5], "a short soak: the warm reading and the end one"
    assert reading_points(25, 5) == [5, 15, 25], "no second reading where the end falls on one"


def test_each_reading_follows_the_probe_a_collection_and_two_cached_probes(monkeypatch):
    events = []
    probe = probe_prompt("sdopt-mini-sd15.safetensors")

    class Server:
        pid = 1

        def poll(self):
            return None

        def queue(self, prompt):
            events.append("probe" if prompt is probe else "prompt")
            return str(len(events))

        def wait(self, prompt_id, timeout):
            return {"status": {"status_str": SUCCESS}}

        def collect_garbage(self):
            events.append("collect")

    def read(pid):
        events.append("read")
        return 2**30

    monkeypatch.setattr(soak_run, "rss_bytes", read)  # where _run_prompts looks it up
    result = SoakResult(seed=0, prompts=3, warmup=1)
    server = Server()
    plan = lambda index: plan_prompt(index, 0, CHECKPOINTS, 1)  # noqa: E731
    soak_run._run_prompts(server, server, result, plan, probe, 1.0, Path("output"), lambda line: None)
    reading = ["probe", "collect", "probe", "probe", "read"]
    each_prompt = ["prompt", "read"]  # and the RSS its line shows
    assert events == [*each_prompt, *reading, *each_prompt, *each_prompt, *reading]
    assert [count for count, _ in result.readings] == [1, 3]


def test_drift_compares_the_medians_of_the_first_and_the_last_three_readings():
    mib = 2**20
    wandering = [(5, 1000), (15, 1080), (25, 990), (35, 1075), (45, 1010), (55, 1085), (65, 1000), (75, 1070), (85, 995),
                 (95, 1078), (100, 1005)]
    result = SoakResult(seed=0, prompts=100, warmup=5, readings=[(count, rss * mib) for count, rss in wandering])
    assert (result.rss_warm_bytes, result.rss_end_bytes) == (1000 * mib, 1005 * mib)
    assert wandering[-1][1] / wandering[0][1] - 1 < 0.01 < wandering[-2][1] / wandering[0][1] - 1, "one pair swings with the wander"
    assert result.drift == pytest.approx(0.005) and not result.problems()

    leaking = SoakResult(seed=0, prompts=100, warmup=5, readings=[(count, (1000 + 10 * count) * mib) for count, _ in wandering])
    assert leaking.drift == pytest.approx((1950 - 1150) / 1150) and leaking.problems() == [f"RSS drift {leaking.drift:+.1%} is above the 5.0% allowed"]

    unfinished = SoakResult(seed=0, prompts=100, warmup=5, readings=[(count, rss * mib) for count, rss in wandering[:4]])
    assert unfinished.drift is None, "no end reading: no drift, whatever was read before"
    assert "15: 1,080 MiB" in result.summary() and "median of 3 readings each" in result.summary()


def test_server_errors_are_read_into_one_message():
    entry = {"status": {"status_str": "error", "completed": False, "messages": [
        ["execution_start", {"prompt_id": "x"}],
        ["execution_error", {"node_id": "model2", "node_type": "SDOptStepCache", "exception_type": "ValueError",
                             "exception_message": "bad branch\n", "traceback": ["  File a.py\n", "ValueError\n"]}]]}}
    assert history_error(entry) == "node model2 SDOptStepCache: ValueError: bad branch\n  File a.py\nValueError"
    body = json.dumps({"error": {"message": "Prompt outputs failed validation"}, "node_errors": {
        "vae0": {"class_type": "SDOptTiledVAE", "errors": [{"message": "Value smaller than min", "details": "budget_mb: -1"}]}}})
    assert _rejection(body) == "Prompt outputs failed validation; node vae0 SDOptTiledVAE: Value smaller than min: budget_mb: -1"
    assert _rejection("<html>500</html>") == "<html>500</html>"


def test_cli_options_and_a_missing_comfyui(capsys, tmp_path, monkeypatch):
    args = build_parser().parse_args(["soak", "--prompts", "5", "--seed", "3", "--max-drift", "2.5", "--comfyui", str(tmp_path)])
    assert (args.prompts, args.seed, args.max_drift, args.warmup, args.model, args.port) == (5, 3, 2.5, 35, None, None)
    assert main(["soak", "--comfyui", str(tmp_path), "--prompts", "1"]) == 2
    assert f"ComfyUI not found at {tmp_path}" in capsys.readouterr().err
    assert main(["soak", "--comfyui", str(tmp_path), "--max-drift", "-1"]) == 2
    for not_a_mini in ("sd35-medium", "flux-schnell", "full"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["soak", "--model", not_a_mini])
    assert "--max-drift -1: give a percentage at or above 0, e.g. 5 for 5%" in capsys.readouterr().err


def test_a_family_with_its_own_text_encoder_file_encodes_through_clip_loader(core_definitions):
    for index in range(10):
        prompt = plan_prompt(index, 0, FLUX).api_prompt()
        _validate(prompt, core_definitions)
        assert prompt["clip"]["inputs"] == {"clip_name": "sdopt-mini-flux-text.safetensors", "type": "stable_diffusion"}
        assert prompt["positive"]["inputs"]["clip"] == prompt["negative"]["inputs"]["clip"] == ["clip", 0]
    probe = probe_prompt("sdopt-mini-flux.safetensors", FLUX["sdopt-mini-flux.safetensors"])
    _validate(probe, core_definitions)
    assert probe["positive"]["inputs"]["clip"] == ["clip", 0]
    assert "clip" not in plan_prompt(0, 0, CHECKPOINTS).api_prompt(), "the other families encode with the checkpoint's CLIP"


def test_step_cache_draws_both_modes():
    modes = {link.inputs["mode"] for index in range(40) for link in plan_prompt(index, 0, CHECKPOINTS).model_chain
             if link.class_type == "SDOptStepCache"}
    assert modes == {"deepcache", "first_block"}


def test_the_server_holds_glibc_s_mmap_threshold_unless_the_caller_set_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = server_env(tmp_path)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(128 * 1024) and env["SDOPT_CACHE_DIR"].startswith(str(tmp_path))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert server_env(tmp_path)["MALLOC_MMAP_THRESHOLD_"] == "4194304"


# --- soak --chaos -----------------------------------------------------------------------------------

def test_disruptions_are_drawn_from_the_seed_and_cover_every_kind():
    planned = [plan_prompt(index, 5, CHECKPOINTS) for index in range(200)]
    drawn = [chaos.plan_disruption(p.index, 5, p) for p in planned]
    assert drawn == [chaos.plan_disruption(p.index, 5, p) for p in planned]
    assert drawn != [chaos.plan_disruption(p.index, 6, p) for p in planned]
    kinds = {(d.kind, d.detail if d.kind != "burst" else "n") for d in drawn if d}
    assert kinds == {("interrupt", phase) for phase in chaos.INTERRUPT_PHASES} | {("free", "before"), ("free", "during"), ("burst", "n")} \
        | {("malformed", breakage) for breakage in chaos.MALFORMED}
    assert 0.2 < sum(d is not None for d in drawn) / len(drawn) < 0.5
    for p, d in zip(planned, drawn):
        assert d != chaos.Disruption("interrupt", "compiling") or "SDOptCompile" in p.nodes(), "a compile to interrupt"
        assert d is None or d.kind != "burst" or chaos.BURST_SIZES[0] <= d.detail <= chaos.BURST_SIZES[1]


@pytest.mark.parametrize("breakage", chaos.MALFORMED)
def test_each_malformed_copy_breaks_what_the_server_checks_and_leaves_the_prompt_alone(breakage, core_definitions):
    for index in range(10):
        prompt = plan_prompt(index, 2, CHECKPOINTS).api_prompt()
        before = json.dumps(prompt, sort_keys=True)
        broken = chaos.malformed_copy(prompt, breakage)
        assert json.dumps(prompt, sort_keys=True) == before
        _validate(prompt, core_definitions)
        with pytest.raises(AssertionError):
            _validate(broken, core_definitions)


def test_a_chain_that_picks_by_timing_or_free_memory_says_so_and_others_must_be_bitwise():
    seen = {bool(chaos.moment_dependent(plan_prompt(index, 0, CHECKPOINTS))) for index in range(60)}
    assert seen == {True, False}
    for index in range(60):
        planned = plan_prompt(index, 0, CHECKPOINTS)
        reason = chaos.moment_dependent(planned)
        assert ("Compile" in reason) == ("SDOptCompile" in planned.nodes())
        if not reason:
            assert all(link.inputs.get("backend") != "auto" and link.inputs.get("dtype") != "auto"
                       for link in (*planned.model_chain, *planned.vae_chain))


def test_a_prompts_end_is_read_from_its_history_entry(tmp_path):
    interrupted = {"status": {"status_str": "error", "messages": [["execution_interrupted", {"node_id": "sampler", "node_type": "KSampler"}]]}}
    failed = {"status": {"status_str": "error", "messages": [["execution_error", {"node_id": "3", "node_type": "VAEDecode",
                                                                                  "exception_type": "RuntimeError", "exception_message": "boom"}]]}}
    done = {"status": {"status_str": SUCCESS, "messages": []},
            "outputs": {"save": {"images": [{"filename": "a_00001_.png", "subfolder": "sdopt-soak", "type": "output"}]}}}
    assert ended_status(interrupted, 5) == (INTERRUPTED, "interrupted at node sampler KSampler")
    assert ended_status(failed, 5)[0] == "error" and "boom" in ended_status(failed, 5)[1]
    assert ended_status(done, 5) == (SUCCESS, "") and ended_status(None, 5) == ("timeout", "no end within 5 s")
    assert chaos.saved_image(done, tmp_path) == tmp_path / "sdopt-soak" / "a_00001_.png"


def test_images_are_compared_in_levels(tmp_path):
    from PIL import Image

    pixels = bytes(range(48))
    Image.frombytes("RGB", (4, 4), pixels).save(tmp_path / "a.png")
    Image.frombytes("RGB", (4, 4), bytes(min(255, p + (3 if i == 5 else 0)) for i, p in enumerate(pixels))).save(tmp_path / "b.png")
    Image.frombytes("RGB", (4, 8), pixels * 2).save(tmp_path / "c.png")
    assert chaos.image_difference(tmp_path / "a.png", tmp_path / "a.png") == (0.0, 0.0)
    assert chaos.image_difference(tmp_path / "a.png", tmp_path / "b.png") == (3.0, pytest.approx(3 / 48))
    assert chaos.image_difference(tmp_path / "a.png", tmp_path / "c.png") == (255.0, 255.0)


def test_the_websocket_messages_tell_the_phase_a_prompt_is_in():
    events = chaos.Events.__new__(chaos.Events)
    events._state, events._changed = {}, threading.Condition()
    events._seen({"type": "executing", "data": {"node": "sampler", "prompt_id": "p"}})
    assert events.wait_for("p", "sampler", 0, timeout=0.01) and not events.wait_for("p", "sampler", 1, timeout=0.01)
    events._seen({"type": "progress", "data": {"value": 1, "max": 2, "node": "sampler", "prompt_id": "p"}})
    assert events.wait_for("p", "sampler", 1, timeout=0.01) and not events.wait_for("p", "decode", 0, timeout=0.01)
    events._seen({"type": "executing", "data": {"node": "decode", "prompt_id": "p"}})
    events._seen({"type": "status", "data": {"status": {}}})
    assert events.wait_for("p", "decode", 0, timeout=0.01)
    events._seen({"type": "execution_success", "data": {"prompt_id": "p"}})
    assert not events.wait_for("p", "decode", 0, timeout=0.01), "an ended prompt has no phase to interrupt"
    assert not events.wait_for("q", "sampler", 0, timeout=0.01)


def test_the_chaos_verdict_adds_malformed_prompts_taken_silences_and_images_off_their_tolerance():
    ok = PromptOutcome(0, "chain a", SUCCESS, 1.0)
    result = chaos.ChaosResult(seed=1, prompts=1, warmup=0, outcomes=[ok], readings=[(0, 100), (1, 100)])
    result.differences = [{"index": 0, "max_levels": 0.0, "mean_levels": 0.0, "allowed": "0 (bitwise)", "within": True}]
    assert result.problems() == [] and result.summary().endswith("passed")
    result.accepted_malformed.append("prompt 3 with input left out")
    result.unanswered.append("after prompt 4")
    result.differences.append({"index": 5, "max_levels": 2.0, "mean_levels": 0.01, "allowed": "0 (bitwise)", "within": False})
    assert result.problems() == ["the server took a malformed prompt: prompt 3 with input left out",
                                 "/system_stats did not answer after prompt 4",
                                 "prompt 5's image is 2 levels (mean 0.01) off the fresh server's, more than 0 (bitwise)"]
    assert result.to_dict()["chaos"]["differences"][1]["index"] == 5 and result.to_dict()["passed"] is False


def test_chaos_without_a_websocket_client_is_refused_before_any_server_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(chaos.importlib.util, "find_spec", lambda name: None if name == "aiohttp" else object())
    monkeypatch.setattr(soak_run, "_server", lambda *args: pytest.fail("a server started"))
    with pytest.raises(UserError, match="^soak --chaos reads the server's websocket with aiohttp"):
        soak_run.soak(tmp_path, tmp_path, prompts=2, chaos=True, model_names=("mini",))
