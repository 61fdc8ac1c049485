"""workflows/sd35_fast.json headless on the SD3.5 mini checkpoint: it runs, Compile compiles SD3's MMDiT
once (ComfyUI runs no DIFFUSION_MODEL wrappers around it; sdopt's APPLY_MODEL router does), the CUDA
graph node passes through on a CPU and says so, the report names SD3.5, its image matches the same
workflow's with every sdopt node bypassed when precision is kept at fp32, and a second prompt with other
steps and seed reuses the compiled code. As shipped (inductor) it runs too."""
import json
import re

import numpy as np
import pytest
from PIL import Image

WORKFLOW = "sd35_fast.json"
SDOPT_NODES = ("SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph", "SDOptProfiler",
               "SDOptVAEPrecision", "SDOptVAEAttention", "SDOptProfileReport")
FP32 = ["SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32", "SDOptVAEPrecision.dtype=default"]
AOT_EAGER = ["SDOptCompile.backend=aot_eager"]
MAX_LEVEL_DIFF = 2
MIN_IDENTICAL_FRACTION = 0.95
BYPASSED = 4


def _image(outcome):
    (path,) = [p for p in outcome.images if p.name.startswith("sd35_fast")]
    return np.asarray(Image.open(path), dtype=np.int16)


def _without_sdopt(workflow: dict) -> dict:
    for node in workflow["nodes"]:
        if node["type"] in SDOPT_NODES:
            node["mode"] = BYPASSED
    return workflow


def _compilations(run) -> int:
    (record,) = [o for o in run["optimizations"] if o["node"] == "SDOptCompile"]
    return int(re.search(r"(\d+) compilation\(s\)", record["active"]).group(1))


@pytest.fixture(scope="module")
def sd35(comfy_host):
    return comfy_host.family("sd35")


@pytest.fixture(scope="module")
def runs(sd35):
    path = sd35.WORKFLOWS / WORKFLOW
    stock = sd35.run(_without_sdopt(json.loads(path.read_text())), sd35.SMALL)
    first = sd35.run(path, sd35.SMALL + FP32 + AOT_EAGER)
    second = sd35.run(path, sd35.SMALL + FP32 + AOT_EAGER + ["KSampler.steps=3", "KSampler.seed=7"])
    return stock, first, second


def test_image_matches_the_workflow_without_sdopt(runs):
    assert runs[0].report is None, "no sdopt node ran"
    difference = np.abs(_image(runs[0]) - _image(runs[1]))
    assert difference.max() <= MAX_LEVEL_DIFF and (difference == 0).mean() >= MIN_IDENTICAL_FRACTION


def test_report_names_sd35_and_says_what_ran(runs):
    (run,) = runs[1].report.runs
    assert run["model_family"] == "SD3.5"
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph"}
    assert records["SDOptCompile"]["active"].startswith("compile-aot_eager-default: 1 input signature(s)")
    assert _compilations(run) == 1
    assert records["SDOptCUDAGraph"]["active"] == "eager" and "CUDA graphs need a CUDA device" in records["SDOptCUDAGraph"]["note"]
    assert {o["node"] for o in runs[1].report.optimizations} - set(records) == {"SDOptVAEPrecision", "SDOptVAEAttention"}


def test_other_steps_and_seed_do_not_recompile(runs):
    (first,), (second,) = runs[1].report.runs, runs[2].report.runs
    assert len(second["steps"]) == 3
    assert _compilations(second) == _compilations(first) == 1


def test_as_shipped(sd35):
    outcome = sd35.run(sd35.WORKFLOWS / WORKFLOW, sd35.SMALL + ["KSampler.steps=3"])
    (run,) = outcome.report.runs
    assert run["label"] == "sd35 fast path" and run["model_family"] == "SD3.5" and len(run["steps"]) == 3
    assert _image(outcome).shape == (64, 64, 3)
