"""workflows/sd35_fast.json headless on the SD3.5 mini checkpoint: it runs, Compile compiles SD3's MMDiT
once (ComfyUI runs no DIFFUSION_MODEL wrappers around it; sdopt's APPLY_MODEL router does), the CUDA
graph node passes through on a CPU and says so, the report names SD3.5, its image matches the same
workflow's with every sdopt node bypassed when precision is kept at fp32, and a second prompt with other
steps and seed reuses the compiled code. Compile runs through aot_eager: inductor's code generation on
the SD3.5 mini is held by tests/host/nodes/test_compile.py."""
import json

import numpy as np
import pytest

WORKFLOW = "sd35_fast.json"
SDOPT_NODES = ("SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph", "SDOptProfiler",
               "SDOptVAEPrecision", "SDOptVAEAttention", "SDOptProfileReport")
FP32 = ["SDOptPrecision.weight_dtype=default", "SDOptPrecision.compute_dtype=fp32", "SDOptVAEPrecision.dtype=default"]
AOT_EAGER = ["SDOptCompile.backend=aot_eager"]
MAX_LEVEL_DIFF = 2
MIN_IDENTICAL_FRACTION = 0.95


@pytest.fixture(scope="module")
def sd35(comfy_host):
    return comfy_host.family("sd35")


@pytest.fixture(scope="module")
def runs(sd35):
    path = sd35.WORKFLOWS / WORKFLOW
    stock = sd35.run(sd35.bypassed(json.loads(path.read_text()), SDOPT_NODES), sd35.SMALL)
    first = sd35.run(path, sd35.SMALL + FP32 + AOT_EAGER)
    second = sd35.run(path, sd35.SMALL + FP32 + AOT_EAGER + ["KSampler.steps=3", "KSampler.seed=7"])
    return stock, first, second


def test_image_matches_the_workflow_without_sdopt(sd35, runs):
    assert runs[0].report is None, "no sdopt node ran"
    difference = np.abs(sd35.image(runs[0], "sd35_fast") - sd35.image(runs[1], "sd35_fast"))
    assert difference.max() <= MAX_LEVEL_DIFF and (difference == 0).mean() >= MIN_IDENTICAL_FRACTION


def test_report_names_sd35_and_says_what_ran(sd35, runs):
    (run,) = runs[1].report.runs
    assert run["model_family"] == "SD3.5"
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph"}
    assert records["SDOptCompile"]["active"].startswith("compile-aot_eager-default: 1 input signature(s)")
    assert sd35.compilations(run) == 1
    assert records["SDOptCUDAGraph"]["active"] == "eager" and "CUDA graphs need a CUDA device" in records["SDOptCUDAGraph"]["note"]
    assert {o["node"] for o in runs[1].report.optimizations} - set(records) == {"SDOptVAEPrecision", "SDOptVAEAttention"}


def test_other_steps_and_seed_do_not_recompile(sd35, runs):
    (first,), (second,) = runs[1].report.runs, runs[2].report.runs
    assert len(second["steps"]) == 3
    assert sd35.compilations(second) == sd35.compilations(first) == 1


def test_as_shipped_but_for_the_backend_it_runs(sd35):
    outcome = sd35.run(sd35.WORKFLOWS / WORKFLOW, sd35.SMALL + AOT_EAGER + ["KSampler.steps=3"])
    (run,) = outcome.report.runs
    assert run["label"] == "sd35 fast path" and run["model_family"] == "SD3.5" and len(run["steps"]) == 3
    assert sd35.image(outcome, "sd35_fast").shape == (64, 64, 3)
