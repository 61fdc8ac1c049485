"""workflows/sd15_precision_attention.json headless: the same image as the baseline when the
settings preserve numerics, a report that lists every requested and active optimization, and
the workflow as shipped (auto precision for the UNet and VAE, auto attention) running to the end."""
import sys

import numpy as np
import pytest
from PIL import Image

# fp32 weights and compute, exact attention: only float rounding separates it from the baseline.
NUMERICS_PRESERVING = [
    "SDOptPrecision.weight_dtype=default",
    "SDOptPrecision.compute_dtype=fp32",
    "SDOptPrecision.tf32=false",
    "SDOptPrecision.channels_last=true",
    "SDOptAttention.backend=xformers",  # made unimportable: falls back to sdpa, and must say so
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
    with pytest.MonkeyPatch.context() as patch:
        for name in ("xformers", "xformers.ops"):
            patch.setitem(sys.modules, name, None)
        baseline = comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", comfy_host.SMALL)
        optimized = comfy_host.run(comfy_host.WORKFLOWS / "sd15_precision_attention.json", comfy_host.SMALL + NUMERICS_PRESERVING)
    return baseline, optimized


def test_image_matches_the_baseline(runs):
    baseline, optimized = (_image(outcome, prefix) for outcome, prefix in zip(runs, ("baseline", "precision_attention")))
    assert baseline.shape == optimized.shape == (64, 64, 3)
    difference = np.abs(baseline - optimized)
    assert difference.max() <= MAX_LEVEL_DIFF
    assert (difference == 0).mean() >= MIN_IDENTICAL_FRACTION


def test_report_lists_requested_and_active(runs):
    report = runs[1].report
    (run,) = report.runs
    assert run["label"] == "precision+attention" and len(run["steps"]) == 2
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
    assert "| precision+attention | SDOptAttention | xformers | sdpa |" in table
    assert "| (outside sampling) | SDOptVAEPrecision | dtype=default, nan_guard=on |" in table


def test_workflow_as_shipped_runs_and_reports_its_picks(comfy_host):
    """The saved settings (auto precision, auto attention), at one step and 64x64."""
    prompt = comfy_host.prompt(comfy_host.WORKFLOWS / "sd15_precision_attention.json", [*comfy_host.SMALL, "KSampler.steps=1"])
    saved = {node["class_type"]: node["inputs"] for node in prompt.values()}
    outcome = comfy_host.host.execute(prompt)
    (image,) = [p for p in outcome.images if p.name.startswith("precision_attention")]
    pixels = np.asarray(Image.open(image))
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0, "a finite, non-blank image"

    (run,) = outcome.report.runs
    records = {o["node"]: o for o in run["optimizations"]}
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
