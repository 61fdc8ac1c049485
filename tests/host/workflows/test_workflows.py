"""Every example workflow in workflows/ headless in real ComfyUI, on its family's generated mini checkpoint.

The tests are drawn from the folder: a workflow's family is the registry's (``sdopt.families``), found
from the generated checkpoint file it loads (``sdopt-mini-sdxl.safetensors`` → SDXL), and its kind from
the node types it holds: a baseline (no sdopt node but the profiler's), a fast path (Compile), a fast
path with a step cache (Step Cache), low VRAM (Offload, Low Memory, Tiled VAE), precision + attention, sdopt Auto.
A new workflow or family joins these tests by itself.

Every run of a workflow is 64x64 with two steps unless said otherwise (the shipped 512 to 2048 and
20 steps would take minutes on a CPU). Each run's report names the run's label and family, counts its
steps, and matches the JSON saved beside it; its image has the requested size and is not blank.
Per kind:
- baseline: the report holds no optimization and lists every node that ran; the same prompt queued again
  shows the first one's figures, marked cached; a missing model and an unknown node are user errors.
- fast path: the image matches the family's baseline (or, where the family has none, the workflow's with
  every sdopt node bypassed) when precision is kept at fp32; the report says what ran (the CUDA graph
  node passes through on a CPU and says so); a second prompt with other steps and seed reuses the
  compiled code; as shipped, its compile step is flagged warm-up and left out of the steady it/s.
  Compile runs through aot_eager but where INDUCTOR_FAMILIES says: dynamo captures the model as it does
  for inductor, while inductor's code generation for the SDXL mini takes 5 to 20 minutes on a 2-core
  CPU (its code generation on the SD3.5 mini is held by tests/host/nodes/test_compile.py).
- step cache (compile as a trace, which the full and shallow calls each get once; 6 steps, fp32): the
  report gives the calls computed against reused, the image differs from the uncached one (interval 1,
  Compile and CUDA Graph bypassed: compile keeps the image, its own tests hold it) and stays an image,
  and the workflow's Note carries the measured error and says what it bounds.
- low VRAM: the image equals the reference's at 64x64 (the low-memory model and the tiled VAE are exact to
  float rounding), and at the larger side of LOW_VRAM_LARGER with a 1 MiB Low Memory budget and the VAE in
  tiles; the report says what each node did on this CPU; the model and VAE the workflow's nodes are given
  sample and decode as before once the patched copies have run.
- auto (goal fit: Low Memory, eager): the report names the stack Auto chose and why, and the image equals
  the reference's as the low-VRAM workflows' do.
- precision + attention: the image matches the baseline's when the settings preserve numerics, the report
  lists every requested and active optimization, and as shipped (auto precision and attention) it runs.

Each workflow's runs go once, in the order its kind lists them (a reference shared by several workflows,
the family's baseline, runs once), when the first of its tests asks; pytest groups a workflow's tests.
"""
import copy
import json
import re
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdopt.families import Family, model_name_of_file, resolve_model

WORKFLOWS = Path(__file__).resolve().parents[3] / "workflows"
# What every run sets on the shipped workflows (512 to 2048 pixels, 20 steps) to stay fast on a CPU.
SMALL = ("KSampler.steps=2", "EmptyLatentImage.width=64", "EmptyLatentImage.height=64")
PROFILER, REPORT = "SDOptProfiler", "SDOptProfileReport"
BASELINE, FAST, STEP_CACHE, LOW_VRAM, PRECISION, AUTO, OTHER = "baseline", "fast", "step cache", "low vram", "precision", "auto", "other"
# Auto's workflows run its fit goal (Low Memory, eager): as shipped it compiles on a CPU, minutes per family
# here, and its compiled stack is held by tests/host/nodes/test_auto.py.
AUTO_FIT = ("SDOptAuto.goal=fit",)

FP32 = ("SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32", "SDOptVAEPrecision.dtype=default")
AOT_EAGER = ("SDOptCompile.backend=aot_eager",)
OTHER_STEPS_AND_SEED = ("KSampler.steps=3", "KSampler.seed=7")
# The families whose fast workflow runs its shipped inductor backend here (see the module's docstring).
INDUCTOR_FAMILIES = ("sd15",)
# inductor reorders fp32 reductions (~1e-5 of the latent): a pixel may round to a neighbouring level.
FAST_MAX_LEVEL_DIFF = 2
FAST_MIN_IDENTICAL_FRACTION = 0.95

STEP_CACHED = ("KSampler.steps=6", "SDOptCompile.mode=trace", "SDOptPrecision.weight_dtype=default",
               "SDOptPrecision.compute_dtype=fp32", "SDOptVAEPrecision.dtype=default")
FORWARD_NODES = ("SDOptCompile", "SDOptCUDAGraph")

# sub_quadratic attention and GroupNorm statistics gathered over tiles differ from the untiled stock
# path by float rounding (~1e-5 relative): a pixel may round to the neighbouring level.
LOW_VRAM_MAX_LEVEL_DIFF = 1


@dataclass(frozen=True)
class Larger:
    """A low-VRAM workflow's larger run (one step): its side and, where its image is compared with the
    reference's at that side, the VAE tile that, with a 1 MiB Low Memory budget and tiling always on,
    slices and tiles what the saved settings leave whole at this size."""

    side: int
    tile: int | None = None

    def overrides(self) -> tuple[str, ...]:
        forced = ("SDOptLowMemory.budget_mb=1", f"SDOptTiledVAE.tile={self.tile}", "SDOptTiledVAE.only_when_needed=false")
        return _size(self.side) + (forced if self.tile else ())


# sd15_lowmem completes at 512 as saved (a 1024 run, which exercises no path 512 does not, made most of
# its test's four minutes in CI); the others are compared with the stock path, sliced and tiled.
LOW_VRAM_LARGER = {"sd15_lowmem": Larger(512), "sdxl_lowvram": Larger(256, tile=128), "flux_lowvram": Larger(128, tile=64)}

# fp32 weights and compute, exact attention: only float rounding separates it from the baseline.
NUMERICS_PRESERVING = (
    "SDOptPrecision.weight_dtype=default",
    "SDOptPrecision.compute_dtype=fp32",
    "SDOptPrecision.tf32=false",
    "SDOptPrecision.channels_last=true",
    "SDOptAttention.backend=xformers",  # made unimportable: falls back to sdpa, and must say so
    "SDOptVAEPrecision.dtype=default",
    "SDOptVAEAttention.backend=sub_quadratic",
)
# 8-bit PNGs of latents that agree to ~1e-5 relative: a pixel may round to the neighbouring level.
PRECISION_MAX_LEVEL_DIFF = 1
PRECISION_MIN_IDENTICAL_FRACTION = 0.99


def _size(side: int, steps: int = 1) -> tuple[str, ...]:
    return (f"KSampler.steps={steps}", f"EmptyLatentImage.width={side}", f"EmptyLatentImage.height={side}")


class Workflow:
    """One file of workflows/: its UI-format data, its family and its kind."""

    def __init__(self, path: Path):
        self.path, self.name = path, path.stem
        self.data = json.loads(path.read_text())
        self.types = {node["type"] for node in self.data["nodes"]}
        self.sdopt_nodes = tuple(sorted(t for t in self.types if t.startswith("SDOpt")))
        self.optimizing = set(self.sdopt_nodes) - {PROFILER, REPORT}

    def __repr__(self) -> str:
        return self.name

    @cached_property
    def family(self) -> Family:
        """The family of the generated checkpoint the workflow loads, by its file name."""
        models = {model_name_of_file(value) for node in self.data["nodes"] for value in _widget_values(node)} - {None}
        assert len(models) == 1, f"{self.path.name} loads {len(models)} generated checkpoints ({sorted(models)}), not one"
        return resolve_model(models.pop())[0]

    @property
    def kind(self) -> str:
        nodes = self.optimizing
        if not nodes:
            return BASELINE
        if "SDOptAuto" in nodes:
            return AUTO
        if "SDOptStepCache" in nodes:
            return STEP_CACHE
        if "SDOptCompile" in nodes:
            return FAST
        if nodes & {"SDOptOffload", "SDOptLowMemory", "SDOptTiledVAE"}:
            return LOW_VRAM
        if nodes & {"SDOptPrecision", "SDOptAttention"}:
            return PRECISION
        return OTHER

    def widgets(self, class_type: str) -> list:
        (values,) = [node["widgets_values"] for node in self.data["nodes"] if node["type"] == class_type]
        return values


def _widget_values(node: dict) -> list:
    values = node.get("widgets_values") or []
    return [v for v in (values.values() if isinstance(values, dict) else values) if isinstance(v, str)]


# Every workflow by name, the baselines first (then by name): a baseline's first run is the reference of its
# family's other workflows, so its own tests, whose requeue must come right after that run, go before theirs.
CATALOG = {w.name: w for w in sorted((Workflow(path) for path in sorted(WORKFLOWS.glob("*.json"))), key=lambda w: w.kind != BASELINE)}


def _named(*kinds: str) -> list[str]:
    return [name for name, workflow in CATALOG.items() if not kinds or workflow.kind in kinds]


@dataclass(frozen=True)
class Run:
    """One headless run of a workflow: its ``--set`` overrides, the node types bypassed (Ctrl+B), whether
    xformers is made unimportable, whether ComfyUI's cache is cleared first (``fresh``), and ``again``: the
    same prompt queued a second time, right after the first."""

    workflow: str
    overrides: tuple[str, ...] = SMALL
    bypass: tuple[str, ...] = ()
    no_xformers: bool = False
    fresh: bool = False
    again: bool = False


def _reference(workflow: Workflow) -> Run:
    """What a workflow's image is compared with: its family's baseline workflow as saved, where the family
    has one, else the workflow itself with every sdopt node bypassed."""
    for other in CATALOG.values():
        if other.kind == BASELINE and other.family.name == workflow.family.name:
            return plan(other)["first"]
    return Run(workflow.name, bypass=workflow.sdopt_nodes)


def plan(workflow: Workflow) -> dict:
    """{role: Run} of a workflow, in the order they run."""
    name, kind = workflow.name, workflow.kind
    if kind == BASELINE:
        return {"first": Run(name, fresh=True), "again": Run(name, again=True)}
    if kind == FAST:
        backend = () if workflow.family.name in INDUCTOR_FAMILIES else AOT_EAGER
        return {"reference": _reference(workflow), "first": Run(name, SMALL + FP32 + backend),
                "second": Run(name, SMALL + FP32 + backend + OTHER_STEPS_AND_SEED), "shipped": Run(name, SMALL + backend + ("KSampler.steps=3",))}
    if kind == STEP_CACHE:
        eager = tuple(item for item in STEP_CACHED if not item.startswith("SDOptCompile"))
        return {"cached": Run(name, SMALL + STEP_CACHED),
                "uncached": Run(name, SMALL + eager + ("SDOptStepCache.interval=1",), bypass=FORWARD_NODES)}
    if kind == LOW_VRAM:
        runs = {"reference": _reference(workflow), "small": Run(name)}
        larger = LOW_VRAM_LARGER.get(name)
        if larger and larger.tile:
            runs["stock larger"] = Run(name, _size(larger.side), bypass=workflow.sdopt_nodes)
        if larger:
            runs["larger"] = Run(name, larger.overrides())
        return runs
    if kind == AUTO:
        return {"reference": _reference(workflow), "fit": Run(name, SMALL + AUTO_FIT)}
    if kind == PRECISION:
        return {"reference": _reference(workflow), "preserving": Run(name, SMALL + NUMERICS_PRESERVING, no_xformers=True),
                "shipped": Run(name, SMALL + ("KSampler.steps=1",))}
    return {"shipped": Run(name)}


class Outcomes:
    """Each Run's WorkflowOutcome, run on first request and kept for the module."""

    def __init__(self, comfy_host):
        self.comfy_host, self.done = comfy_host, {}

    def __call__(self, run: Run):
        if run not in self.done:
            workflow = CATALOG[run.workflow]
            host = self.comfy_host.family(workflow.family.name)
            if run.fresh:
                host.host.clear_cache()
            source = host.bypassed(copy.deepcopy(workflow.data), run.bypass) if run.bypass else workflow.path
            with pytest.MonkeyPatch.context() as patch:
                if run.no_xformers:
                    for module in ("xformers", "xformers.ops"):
                        patch.setitem(sys.modules, module, None)
                self.done[run] = host.run(source, run.overrides)
        return self.done[run]


@pytest.fixture(scope="module")
def outcomes(comfy_host):
    return Outcomes(comfy_host)


@pytest.fixture(scope="module")
def workflow(request) -> Workflow:
    """The workflow a test is parametrized with (indirectly, so that pytest groups each workflow's tests)."""
    return CATALOG[request.param]


@pytest.fixture(scope="module")
def host(comfy_host, workflow):
    return comfy_host.family(workflow.family.name)


@pytest.fixture(scope="module")
def runs(workflow, host, outcomes) -> dict:
    return {role: outcomes(run) for role, run in plan(workflow).items()}


def _inputs(prompt: dict) -> dict:
    """{class type: inputs} of an API prompt's nodes."""
    return {node["class_type"]: node["inputs"] for node in prompt.values()}


def _image(host, outcome):
    """The image the run's SaveImage saved, as int16 levels."""
    return host.image(outcome, _inputs(outcome.prompt)["SaveImage"]["filename_prefix"].rsplit("/", 1)[-1])


def _records(outcome) -> tuple[dict, dict]:
    (run,) = outcome.report.runs
    return run, {o["node"]: o for o in run["optimizations"]}


def _warmup(run) -> list[list[str]]:
    return [sorted(step["warmup"]) for step in run["steps"]]


# Every workflow


@pytest.mark.parametrize("workflow", _named(), indirect=True)
def test_it_runs_and_its_report_says_what_ran(workflow, host, runs):
    """Every run of the workflow with its profiler (not a reference, not a requeue)."""
    checked = [role for role, run in plan(workflow).items() if run.workflow == workflow.name and PROFILER not in run.bypass and not run.again]
    assert checked
    for role in checked:
        outcome, inputs = runs[role], _inputs(runs[role].prompt)
        report = outcome.report.to_dict()
        assert report["sdopt_report"] == 2 and report["comfyui"], role
        assert report["cached"] is False, role
        (run,) = report["runs"]
        steps = inputs["KSampler"]["steps"]
        assert run["label"] == inputs[PROFILER]["label"] and run["model_family"] == workflow.family.title, role
        assert len(run["steps"]) == steps, role
        assert run["sampler_total_s"] >= sum(step["seconds"] for step in run["steps"])
        assert run["peak_memory_bytes"] > 0
        assert run["memory_kind"] in ("ram_rss", "vram_allocated")
        assert json.loads(outcome.report_path.read_text()) == report, role
        assert f"| {run['label']} | {steps} |" in outcome.report.markdown(), role
        pixels = _image(host, outcome)
        latent = inputs["EmptyLatentImage"]
        assert pixels.shape == (latent["height"], latent["width"], 3) and pixels.std() > 0, f"{role}: a finite, non-blank image"
        chart_prefix = inputs[REPORT]["filename_prefix"].rsplit("/", 1)[-1]
        chart = next(path for path in outcome.images if path.name.startswith(chart_prefix))
        assert Image.open(chart).format == "PNG"


# Baseline


@pytest.mark.parametrize("workflow", _named(BASELINE), indirect=True)
def test_baseline_report_has_no_optimization_and_lists_every_executed_node(runs):
    report = runs["first"].report.to_dict()
    (run,) = report["runs"]
    assert run["optimizations"] == [], "the baseline has no sdopt optimization"
    assert report["optimizations"] == []
    classes = [node["class_type"] for node in report["nodes"]]
    for expected in ("CheckpointLoaderSimple", "KSampler", "VAEDecode", PROFILER):
        assert expected in classes
    assert REPORT not in classes, "the report is built while its own node runs"
    ksampler = next(node for node in report["nodes"] if node["class_type"] == "KSampler")
    assert ksampler["seconds"] >= run["sampler_total_s"]


@pytest.mark.parametrize("workflow", _named(BASELINE), indirect=True)
def test_baseline_report_reruns_on_every_queue(runs):
    first, again = runs["first"], runs["again"]
    assert again.report_path != first.report_path
    # Every node but the report is cached: the second queue shows the first one's figures, marked cached.
    assert again.report.cached is True
    assert again.report.runs == first.report.runs
    assert any("ComfyUI reused cached results" in note for note in again.report.notes)


@pytest.mark.parametrize("workflow", _named(BASELINE), indirect=True)
def test_baseline_cli_errors_for_unknown_node_and_missing_model(workflow, host):
    from sdopt.errors import UserError

    data = copy.deepcopy(workflow.data)
    loader = next(node for node in data["nodes"] if node["type"] == "CheckpointLoaderSimple")
    loader["widgets_values"] = ["nope.safetensors"]
    with pytest.raises(UserError, match=r"missing model file 'nope.safetensors'.*sdopt make-model NAME --out .*nope.safetensors.*NAME: tiny, mini, full, .*sdxl-tiny"):
        host.run(data, SMALL)
    data["nodes"].append({"id": 99, "type": "NotANode", "mode": 0, "inputs": [], "outputs": []})
    with pytest.raises(UserError, match="unknown node type NotANode"):
        host.run(data, SMALL)
    with pytest.raises(UserError, match="matches no node"):
        host.run(workflow.path, ["KSamplerX.steps=2"])


# Fast path


@pytest.mark.parametrize("workflow", _named(FAST), indirect=True)
def test_fast_image_matches_the_reference(workflow, host, runs):
    if plan(workflow)["reference"].bypass:
        assert runs["reference"].report is None, "no sdopt node ran"
    difference = np.abs(_image(host, runs["reference"]) - _image(host, runs["first"]))
    assert difference.max() <= FAST_MAX_LEVEL_DIFF and (difference == 0).mean() >= FAST_MIN_IDENTICAL_FRACTION


@pytest.mark.parametrize("workflow", _named(FAST), indirect=True)
def test_fast_report_names_the_family_and_says_what_ran(workflow, host, runs):
    outcome = runs["first"]
    run, records = _records(outcome)
    inputs = _inputs(outcome.prompt)
    backend = inputs["SDOptCompile"]["backend"]
    assert re.search(rf"\| {re.escape(workflow.family.title)} +\|", outcome.report.markdown()), "the profile table's model column"
    assert set(records) == {"SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph"}
    assert records["SDOptCompile"]["active"].startswith(f"compile-{backend}-default: 1 input signature(s)")
    if backend == "aot_eager":
        assert host.compilations(run) == 1, "sdopt Attention (sdpa) keeps the diffusion model one graph"
    if inputs["SDOptPrecision"]["channels_last"]:
        assert records["SDOptPrecision"]["active"].endswith(", channels_last"), "the conv weights are channels-last, as inductor runs them"
        assert "stored NCHW" not in records["SDOptCompile"]["note"]
    assert records["SDOptCUDAGraph"]["active"] == "eager" and "CUDA graphs need a CUDA device" in records["SDOptCUDAGraph"]["note"]
    assert {o["node"] for o in outcome.report.optimizations} - set(records) == {"SDOptVAEPrecision", "SDOptVAEAttention"}


@pytest.mark.parametrize("workflow", _named(FAST), indirect=True)
def test_fast_other_steps_and_seed_do_not_recompile(workflow, host, runs):
    (first, _), (second, _) = _records(runs["first"]), _records(runs["second"])
    assert len(second["steps"]) == 3
    assert host.compilations(second) == host.compilations(first) >= 1
    if _inputs(runs["first"].prompt)["SDOptCompile"]["backend"] == "aot_eager":
        assert host.compilations(first) == 1
    assert _warmup(first) == [[], ["compile"]] and first["steady_steps"] == [0], (
        "the first call of a shape runs eagerly, so two steps compile in step 1 and leave only the first"
    )
    assert _warmup(second) == [[], [], []] and second["steady_steps"] == [1, 2], "nothing compiles: no warm-up step"


@pytest.mark.parametrize("workflow", _named(FAST), indirect=True)
def test_fast_as_shipped_its_compile_step_stays_out_of_the_steady_rate(runs):
    """As shipped but for the backend (see INDUCTOR_FAMILIES), at 3 steps."""
    outcome = runs["shipped"]
    run, _ = _records(outcome)
    assert len(run["steps"]) == 3
    compiling = run["steps"][1]
    assert _warmup(run) == [[], ["compile"], []] and 0 < compiling["warmup"]["compile"] <= compiling["seconds"]
    assert run["steady_steps"] == [2] and run["steady_it_per_s"] == pytest.approx(1 / run["steps"][2]["seconds"])
    assert f" 1: compile {compiling['warmup']['compile']:.1f} s " in outcome.report.markdown()


# Fast path with a step cache


@pytest.mark.parametrize("workflow", _named(STEP_CACHE), indirect=True)
def test_step_cache_report_gives_calls_computed_against_reused(runs):
    (_, cached), (_, uncached) = _records(runs["cached"]), _records(runs["uncached"])
    assert cached["SDOptStepCache"]["active"] == "deepcache: interval 3, branch 0: 2 of 6 calls ran the whole UNet, 4 reused deep features"
    assert "its image differs from the uncached one" in cached["SDOptStepCache"]["note"]
    assert uncached["SDOptStepCache"]["active"].endswith("6 of 6 calls ran the whole UNet, 0 reused deep features")
    assert "interval 1 reuses nothing: every call runs whole, so its image is the uncached one" in uncached["SDOptStepCache"]["note"]
    assert not uncached["SDOptStepCache"].get("short"), "interval 1 asks for no reuse: nothing fell short"
    assert cached["SDOptCompile"]["active"].count("1 compilation(s)") == 2, "the full call's and the shallow call's"


@pytest.mark.parametrize("workflow", _named(STEP_CACHE), indirect=True)
def test_step_cache_image_differs_from_the_uncached_one(host, runs):
    cached, uncached = _image(host, runs["cached"]), _image(host, runs["uncached"])
    assert cached.shape == uncached.shape == (64, 64, 3) and np.abs(cached - uncached).max() > 0


@pytest.mark.parametrize("workflow", _named(STEP_CACHE), indirect=True)
def test_step_cache_note_carries_the_measured_error_and_what_it_bounds(workflow):
    note = workflow.widgets("Note")[0]
    assert "PSNR" in note and "random weights" in note.lower() and "lossless" not in note.replace("not lossless", "")
    assert workflow.widgets("SDOptStepCache")[:3] == ["deepcache", 3, 0], "DeepCache's published settings"


# Low VRAM


def _low_vram_equal(host, reference, patched, side: int, stock: bool) -> None:
    if stock:
        assert reference.report is None, "no sdopt node ran"
    image = _image(host, patched)
    assert image.shape == (side, side, 3)
    assert np.abs(_image(host, reference) - image).max() <= LOW_VRAM_MAX_LEVEL_DIFF


@pytest.mark.parametrize("workflow", _named(LOW_VRAM), indirect=True)
def test_low_vram_image_equals_the_reference_as_saved(workflow, host, runs):
    """At 64x64 with the saved settings."""
    _low_vram_equal(host, runs["reference"], runs["small"], 64, stock=bool(plan(workflow)["reference"].bypass))


@pytest.mark.parametrize("workflow", [name for name in _named(LOW_VRAM) if "stock larger" in plan(CATALOG[name])], indirect=True)
def test_low_vram_image_equals_the_stock_path_sliced_and_tiled(workflow, host, runs):
    """At the larger side of LOW_VRAM_LARGER, with a 1 MiB budget and the VAE in tiles."""
    _low_vram_equal(host, runs["stock larger"], runs["larger"], LOW_VRAM_LARGER[workflow.name].side, stock=True)


@pytest.mark.parametrize("workflow", _named(LOW_VRAM), indirect=True)
def test_low_vram_report_says_what_ran_on_this_cpu(workflow, runs):
    """At 64x64 as saved, and at the larger side (the budget and tile forced where it is compared)."""
    for role in ("small", "larger"):
        if role not in runs:
            continue
        outcome, larger = runs[role], LOW_VRAM_LARGER.get(workflow.name) if role == "larger" else None
        _, records = _records(outcome)
        inputs = _inputs(outcome.prompt)
        assert set(records) == {"SDOptOffload", "SDOptLowMemory", "SDOptAttention"}
        assert records["SDOptOffload"]["active"] == "no-op" and "CPU" in records["SDOptOffload"]["note"]
        low = records["SDOptLowMemory"]
        assert low["active"].startswith(f"budget {inputs['SDOptLowMemory']['budget_mb']} MiB"), (role, low)
        assert "feed-forwards" in low["active"], (role, low)
        assert ("has no GroupNorms" in low["note"]) == bool(workflow.family.block_groups), (role, low)
        assert records["SDOptAttention"]["active"] == "sdpa_fused", "PyTorch's CPU flash kernel takes every attention call"
        (tiled,) = [o for o in outcome.report.optimizations if o["node"] == "SDOptTiledVAE"]
        if larger and larger.tile:
            assert tiled["requested"].startswith(f"tile={larger.tile}") and "2x2 = 4 tiles" in tiled["active"], tiled
        else:
            assert tiled["requested"].startswith("tile=auto"), tiled
        if role == "small":
            assert tiled["active"].startswith("decode: untiled (fits"), tiled


def _patched_copies(host, workflow: Workflow) -> list[tuple]:
    """(what the checkpoint loader gives, what the last of the workflow's optimizing nodes fed by it
    returns) for each loader output those nodes take: the nodes applied in process to the shared
    checkpoint with the workflow's own settings, chained as its links chain them."""
    prompt = host.prompt(workflow.path)
    loader = host.node_id(prompt, "CheckpointLoaderSimple")
    copies = []
    for slot, given in enumerate(host.load_checkpoint()):
        link, patched = [loader, slot], given
        while found := [(key, node) for key, node in prompt.items()
                        if node["class_type"] in workflow.optimizing and link in node["inputs"].values()]:
            ((key, node),) = found
            cls = host.nodes[node["class_type"]]
            patched = getattr(cls(), cls.FUNCTION)(**{name: patched if value == link else value for name, value in node["inputs"].items()})[0]
            link = [key, 0]
        if patched is not given:
            copies.append((given, patched))
    return copies


@pytest.mark.parametrize("workflow", _named(AUTO), indirect=True)
def test_auto_report_names_its_stack_and_its_image_equals_the_reference(workflow, host, runs):
    _, records = _records(runs["fit"])
    auto = records["SDOptAuto"]
    assert auto["active"] == "low memory 64 MiB: Low Memory(64 MiB)", auto
    assert "decided for 1x" in auto["note"] and "predicted step working peak" in auto["note"], auto
    assert records["SDOptLowMemory"]["active"].startswith("budget 64 MiB") and "SDOptTiledVAE" not in records
    _low_vram_equal(host, runs["reference"], runs["fit"], 64, stock=bool(plan(workflow)["reference"].bypass))


@pytest.mark.parametrize("workflow", _named(LOW_VRAM), indirect=True)
def test_low_vram_the_models_it_was_given_are_unchanged(workflow, host, prompt_context):
    """The workflow's own node settings, applied in process to the shared checkpoint."""
    model, _, vae = host.load_checkpoint()
    latent = host.sample(model)
    image = vae.decode(latent)
    copies = dict((id(given), patched) for given, patched in _patched_copies(host, workflow))
    assert set(copies) == {id(model), id(vae)}, "the workflow patches the model and the VAE"
    copies[id(vae)].decode(host.sample(copies[id(model)]))
    assert torch.equal(host.sample(model), latent)
    assert torch.equal(vae.decode(latent), image)


# Precision + attention


@pytest.mark.parametrize("workflow", _named(PRECISION), indirect=True)
def test_precision_image_matches_the_reference(host, runs):
    reference, optimized = _image(host, runs["reference"]), _image(host, runs["preserving"])
    assert reference.shape == optimized.shape == (64, 64, 3)
    difference = np.abs(reference - optimized)
    assert difference.max() <= PRECISION_MAX_LEVEL_DIFF
    assert (difference == 0).mean() >= PRECISION_MIN_IDENTICAL_FRACTION


@pytest.mark.parametrize("workflow", _named(PRECISION), indirect=True)
def test_precision_report_lists_requested_and_active(workflow, runs):
    report = runs["preserving"].report
    (run,) = report.runs
    label = workflow.widgets(PROFILER)[0]
    assert len(run["steps"]) == 2
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptPrecision", "SDOptAttention"}, "one record per node"
    precision = records["SDOptPrecision"]
    assert precision["requested"] == "weight=default, compute=fp32, tf32=off, channels_last=on"
    assert precision["active"] == "weight=fp32, compute=fp32, channels_last"
    attention = records["SDOptAttention"]
    assert attention["requested"] == "xformers"
    assert attention["active"] == "sdpa" and "fallback" in attention["note"] and "pip install xformers" in attention["note"]
    prompt_records = {o["node"]: o for o in report.optimizations}
    assert set(prompt_records) == {"SDOptVAEPrecision", "SDOptVAEAttention"}
    assert prompt_records["SDOptVAEPrecision"]["requested"] == "dtype=default, nan_guard=on"
    assert prompt_records["SDOptVAEAttention"]["active"].startswith("sub_quadratic")
    table = report.markdown()
    assert f"| {label} | SDOptAttention | xformers | sdpa |" in table
    assert "| (outside sampling) | SDOptVAEPrecision | dtype=default, nan_guard=on |" in table


@pytest.mark.parametrize("workflow", _named(PRECISION), indirect=True)
def test_precision_as_shipped_reports_its_picks(runs):
    """The saved settings (auto precision, auto attention), at one step and 64x64."""
    outcome = runs["shipped"]
    saved = _inputs(outcome.prompt)
    _, records = _records(outcome)
    weight = saved["SDOptPrecision"]["weight_dtype"]
    assert records["SDOptPrecision"]["requested"].startswith(f"weight={weight}, compute={saved['SDOptPrecision']['compute_dtype']},")
    assert records["SDOptPrecision"]["note"].startswith("auto: ") == (weight == "auto")
    assert records["SDOptAttention"]["requested"] == saved["SDOptAttention"]["backend"]
    assert records["SDOptAttention"]["active"] != "auto (pending)"

    vae = {o["node"]: o for o in outcome.report.optimizations}
    dtype, guard = saved["SDOptVAEPrecision"]["dtype"], "on" if saved["SDOptVAEPrecision"]["nan_guard"] else "off"
    assert vae["SDOptVAEPrecision"]["requested"] == f"dtype={dtype}, nan_guard={guard}"
    assert vae["SDOptVAEPrecision"]["note"].startswith("auto: ") == (dtype == "auto")
    assert vae["SDOptVAEAttention"]["requested"] == saved["SDOptVAEAttention"]["backend"]
    assert vae["SDOptVAEAttention"]["active"] != "auto (pending)"
