"""workflows/sd15_fast.json headless on the mini checkpoint: it runs as shipped (compile with
inductor; the CUDA graph node passes through on a CPU and says so), its image matches the
baseline's when precision is kept at fp32, and a second prompt with other steps and seed
reuses the compiled code (the Compile record's compilation count does not grow). The step that
compiles is flagged warm-up and left out of the steady it/s."""
import re

import numpy as np
import pytest
from PIL import Image

FP32 = ["SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32", "SDOptVAEPrecision.dtype=default"]
# inductor reorders fp32 reductions (~1e-5 of the latent): a pixel may round to a neighbouring level.
MAX_LEVEL_DIFF = 2
MIN_IDENTICAL_FRACTION = 0.95


def _image(outcome, prefix):
    (path,) = [p for p in outcome.images if p.name.startswith(prefix)]
    return np.asarray(Image.open(path), dtype=np.int16)


def _warmup(run) -> list[list[str]]:
    return [sorted(step["warmup"]) for step in run["steps"]]


def _compilations(run) -> int:
    (record,) = [o for o in run["optimizations"] if o["node"] == "SDOptCompile"]
    return int(re.search(r"(\d+) compilation\(s\)", record["active"]).group(1))


@pytest.fixture(scope="module")
def runs(comfy_host):
    workflow = comfy_host.WORKFLOWS / "sd15_fast.json"
    baseline = comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", comfy_host.SMALL)
    first = comfy_host.run(workflow, comfy_host.SMALL + FP32)
    second = comfy_host.run(workflow, comfy_host.SMALL + FP32 + ["KSampler.steps=3", "KSampler.seed=7"])
    return baseline, first, second


def test_image_matches_the_baseline(runs):
    baseline, fast = _image(runs[0], "baseline"), _image(runs[1], "fast")
    difference = np.abs(baseline - fast)
    assert difference.max() <= MAX_LEVEL_DIFF and (difference == 0).mean() >= MIN_IDENTICAL_FRACTION


def test_report_says_what_ran(runs):
    (run,) = runs[1].report.runs
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph"}
    assert records["SDOptCompile"]["active"].startswith("compile-inductor-default: 1 input signature(s)")
    assert records["SDOptPrecision"]["active"].endswith(", channels_last"), "the conv weights are channels-last, as inductor runs them"
    assert "stored NCHW" not in records["SDOptCompile"]["note"]
    assert records["SDOptCUDAGraph"]["active"] == "eager" and "CUDA graphs need a CUDA device" in records["SDOptCUDAGraph"]["note"]


def test_other_steps_and_seed_do_not_recompile(runs):
    (first,), (second,) = runs[1].report.runs, runs[2].report.runs
    assert len(second["steps"]) == 3
    assert _compilations(second) == _compilations(first) >= 1
    assert _warmup(first) == [[], ["compile"]] and first["steady_steps"] == [0], (
        "the first call of a shape runs eagerly, so two steps compile in step 1 and leave only the first"
    )
    assert _warmup(second) == [[], [], []] and second["steady_steps"] == [1, 2], "nothing compiles: no warm-up step"


def test_as_shipped_it_runs_and_its_compile_step_stays_out_of_the_steady_rate(comfy_host):
    outcome = comfy_host.run(comfy_host.WORKFLOWS / "sd15_fast.json", comfy_host.SMALL + ["KSampler.steps=3"])
    (run,) = outcome.report.runs
    assert run["label"] == "fast path" and len(run["steps"]) == 3
    compiling = run["steps"][1]
    assert _warmup(run) == [[], ["compile"], []] and 0 < compiling["warmup"]["compile"] <= compiling["seconds"]
    assert run["steady_steps"] == [2] and run["steady_it_per_s"] == pytest.approx(1 / run["steps"][2]["seconds"])
    assert f" 1: compile {compiling['warmup']['compile']:.1f} s " in outcome.report.markdown()
