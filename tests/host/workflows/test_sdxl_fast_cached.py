"""workflows/sdxl_fast_cached.json headless on the SDXL mini checkpoint (compile as a trace, which the
step cache's full and shallow calls each get once; 64x64, 6 steps, fp32): the report names SDXL and
gives the calls computed against reused, the image differs from the uncached one (interval 1, Compile
and CUDA Graph bypassed) and stays an image, and the workflow's Note carries the measured error and
says what it bounds."""
import json

import numpy as np
import pytest

WORKFLOW = "sdxl_fast_cached.json"
FAST = ["KSampler.steps=6", "SDOptCompile.mode=trace", "SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32",
        "SDOptVAEPrecision.dtype=default"]


@pytest.fixture(scope="module")
def sdxl(comfy_host):
    return comfy_host.family("sdxl")


@pytest.fixture(scope="module")
def runs(sdxl):
    cached = sdxl.run(sdxl.WORKFLOWS / WORKFLOW, sdxl.SMALL + FAST)
    # uncached, and eager: compile keeps the image (its own tests hold it), and a second trace of the SDXL mini costs CI time
    eager = sdxl.bypassed(json.loads((sdxl.WORKFLOWS / WORKFLOW).read_text()), ("SDOptCompile", "SDOptCUDAGraph"))
    uncached = sdxl.run(eager, sdxl.SMALL + [item for item in FAST if not item.startswith("SDOptCompile")] + ["SDOptStepCache.interval=1"])
    return cached, uncached


def _records(outcome):
    (run,) = outcome.report.runs
    return run, {o["node"]: o for o in run["optimizations"]}


def test_report_names_sdxl_and_gives_calls_computed_against_reused(runs):
    (run, cached), (_, uncached) = (_records(outcome) for outcome in runs)
    assert "SDXL" in json.dumps(run)
    assert cached["SDOptStepCache"]["active"] == "deepcache: interval 3, branch 0: 2 of 6 calls ran the whole UNet, 4 reused deep features"
    assert uncached["SDOptStepCache"]["active"].endswith("6 of 6 calls ran the whole UNet, 0 reused deep features")
    assert cached["SDOptCompile"]["active"].count("1 compilation(s)") == 2, "the full call's and the shallow call's"


def test_the_cached_image_differs_from_the_uncached_one(sdxl, runs):
    cached, uncached = (sdxl.image(outcome, "sdxl_fast_cached").astype(np.int16) for outcome in runs)
    assert cached.shape == uncached.shape == (64, 64, 3) and np.abs(cached - uncached).max() > 0


def test_the_note_carries_the_measured_error_and_what_it_bounds(sdxl):
    workflow = json.loads((sdxl.WORKFLOWS / WORKFLOW).read_text())
    (note,) = [node["widgets_values"][0] for node in workflow["nodes"] if node["type"] == "Note"]
    assert "PSNR" in note and "random weights" in note.lower() and "lossless" not in note.replace("not lossless", "")
    (step_cache,) = [node["widgets_values"] for node in workflow["nodes"] if node["type"] == "SDOptStepCache"]
    assert step_cache[:3] == ["deepcache", 3, 0], "DeepCache's published settings"
