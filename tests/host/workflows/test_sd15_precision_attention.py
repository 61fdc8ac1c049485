"""workflows/sd15_precision_attention.json headless: same image as the baseline when the settings
preserve numerics, and a report that lists every requested and active optimization."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
SMALL = ["KSampler.steps=2", "EmptyLatentImage.width=128", "EmptyLatentImage.height=128"]
# fp32 weights and compute, exact attention: only float rounding separates it from the baseline.
NUMERICS_PRESERVING = [
    "SDOptPrecision.weight_dtype=default",
    "SDOptPrecision.compute_dtype=fp32",
    "SDOptPrecision.tf32=false",
    "SDOptPrecision.channels_last=true",
    "SDOptAttention.backend=xformers",  # not installed here: falls back to sdpa, and must say so
    "SDOptVAEPrecision.dtype=default",
    "SDOptVAEAttention.backend=sub_quadratic",
]
# 8-bit PNGs of latents that agree to ~1e-5 relative: a pixel may round to the neighbouring level.
MAX_LEVEL_DIFF = 1
MIN_IDENTICAL_FRACTION = 0.99


def _image(outcome, prefix):
    (path,) = [p for p in outcome.images if p.name.startswith(prefix)]
    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.fixture(scope="module")
def runs(comfy_host):
    baseline = comfy_host.run(WORKFLOWS / "sd15_baseline.json", SMALL)
    optimized = comfy_host.run(WORKFLOWS / "sd15_precision_attention.json", SMALL + NUMERICS_PRESERVING)
    return baseline, optimized


def test_image_matches_the_baseline(runs):
    baseline, optimized = (_image(outcome, prefix) for outcome, prefix in zip(runs, ("baseline", "precision_attention")))
    assert baseline.shape == optimized.shape == (128, 128, 3)
    difference = np.abs(baseline - optimized)
    assert difference.max() <= MAX_LEVEL_DIFF
    assert (difference == 0).mean() >= MIN_IDENTICAL_FRACTION


def test_report_lists_requested_and_active(runs):
    report = runs[1].report
    (run,) = report.runs
    assert run["label"] == "precision+attention" and len(run["steps"]) == 2
    records = {(o["node"], o["requested"]): o for o in run["optimizations"]}
    assert records[("SDOptPrecision", "compute=fp32")]["active"].startswith("compute=fp32")
    assert records[("SDOptPrecision", "channels_last")]["active"].startswith("channels_last")
    attention = records[("SDOptAttention", "xformers")]
    assert attention["active"] == "sdpa" and "fallback" in attention["note"] and "pip install xformers" in attention["note"]
    prompt_records = {o["node"]: o for o in report.optimizations}
    assert prompt_records["SDOptVAEPrecision"]["requested"] == "dtype=default, nan_guard=on"
    assert prompt_records["SDOptVAEAttention"]["active"].startswith("sub_quadratic")
    table = report.markdown()
    assert "| precision+attention | SDOptAttention | xformers | sdpa |" in table
