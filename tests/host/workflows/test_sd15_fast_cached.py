"""workflows/sd15_fast_cached.json headless on the mini checkpoint (compile as a trace, which the
step cache's full and shallow calls each get once; 64x64, 6 steps, fp32): the report gives the calls
computed against reused, the image differs from the uncached one (interval 1) and stays an image, and
the workflow's Note carries the measured error and says what it bounds."""
import json

import numpy as np
import pytest
from PIL import Image

WORKFLOW = "sd15_fast_cached.json"
FAST = ["KSampler.steps=6", "SDOptCompile.mode=trace", "SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32",
        "SDOptVAEPrecision.dtype=default"]


def _image(outcome):
    (path,) = [p for p in outcome.images if p.name.startswith("fast_cached")]
    return np.asarray(Image.open(path), dtype=np.int16)


def _records(outcome):
    (run,) = outcome.report.runs
    return {o["node"]: o for o in run["optimizations"]}


@pytest.fixture(scope="module")
def runs(comfy_host):
    cached = comfy_host.run(comfy_host.WORKFLOWS / WORKFLOW, comfy_host.SMALL + FAST)
    uncached = comfy_host.run(comfy_host.WORKFLOWS / WORKFLOW, comfy_host.SMALL + FAST + ["SDOptStepCache.interval=1"])
    return cached, uncached


def test_report_gives_calls_computed_against_reused(runs):
    cached, uncached = (_records(outcome) for outcome in runs)
    assert cached["SDOptStepCache"]["active"] == "deepcache: interval 3, branch 0: 2 of 6 calls ran the whole UNet, 4 reused deep features"
    assert "its image differs from the uncached one" in cached["SDOptStepCache"]["note"]
    assert uncached["SDOptStepCache"]["active"].endswith("6 of 6 calls ran the whole UNet, 0 reused deep features")
    assert cached["SDOptCompile"]["active"].count("1 compilation(s)") == 2, "the full call's and the shallow call's"


def test_the_cached_image_differs_from_the_uncached_one(runs):
    cached, uncached = (_image(outcome) for outcome in runs)
    assert cached.shape == uncached.shape and np.abs(cached - uncached).max() > 0


def test_the_note_carries_the_measured_error_and_what_it_bounds(comfy_host):
    workflow = json.loads((comfy_host.WORKFLOWS / WORKFLOW).read_text())
    (note,) = [node["widgets_values"][0] for node in workflow["nodes"] if node["type"] == "Note"]
    assert "PSNR" in note and "random weights" in note.lower() and "lossless" not in note.replace("not lossless", "")
