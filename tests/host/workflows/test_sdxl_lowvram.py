"""workflows/sdxl_lowvram.json headless on the SDXL mini checkpoint: its image equals the same workflow's
with every sdopt node bypassed, as saved at 64x64 (2 steps), and at 256x256 (1 step) with a 1 MiB Low
Memory budget, which slices the UNet's full-resolution convolutions, and the VAE decoded in four tiles:
the low-memory UNet and the tiled VAE are exact to float rounding. The report names SDXL and says what
each node did on this CPU; the model and VAE the workflow's nodes are given sample and decode as before
once the patched copies have run."""
import json

import numpy as np
import pytest
import torch

WORKFLOW = "sdxl_lowvram.json"
SDOPT_NODES = ("SDOptOffload", "SDOptLowMemory", "SDOptTiledVAE", "SDOptProfiler", "SDOptProfileReport")
# sub_quadratic attention and GroupNorm statistics gathered over tiles differ from the untiled stock
# path by float rounding (~1e-5 relative): a pixel may round to the neighbouring level.
MAX_LEVEL_DIFF = 1
# At 256x256 these slice and tile what the saved settings leave whole at this size.
FORCE_SLICES = ["SDOptLowMemory.budget_mb=1", "SDOptTiledVAE.tile=128", "SDOptTiledVAE.only_when_needed=false"]


def _size(side, steps=1):
    return [f"KSampler.steps={steps}", f"EmptyLatentImage.width={side}", f"EmptyLatentImage.height={side}"]


@pytest.fixture(scope="module")
def sdxl(comfy_host):
    return comfy_host.family("sdxl")


@pytest.fixture(scope="module")
def runs(sdxl):
    path = sdxl.WORKFLOWS / WORKFLOW
    stock = sdxl.bypassed(json.loads(path.read_text()), SDOPT_NODES)
    return {
        "stock 64": sdxl.run(stock, sdxl.SMALL),
        64: sdxl.run(path, sdxl.SMALL),
        "stock 256": sdxl.run(stock, _size(256)),
        256: sdxl.run(path, _size(256) + FORCE_SLICES),
    }


def test_it_completes(sdxl, runs):
    (run,) = runs[256].report.runs
    assert run["label"] == "sdxl low vram" and len(run["steps"]) == 1
    assert sdxl.image(runs[256], "sdxl_lowvram").shape == (256, 256, 3)


@pytest.mark.parametrize("side", [64, 256])
def test_image_equals_the_workflow_without_sdopt(sdxl, runs, side):
    stock, patched = sdxl.image(runs[f"stock {side}"], "sdxl_lowvram"), sdxl.image(runs[side], "sdxl_lowvram")
    assert runs[f"stock {side}"].report is None, "no sdopt node ran"
    assert np.abs(stock - patched).max() <= MAX_LEVEL_DIFF


def _vae_record(outcome) -> dict:
    (tiled,) = [o for o in outcome.report.optimizations if o["node"] == "SDOptTiledVAE"]
    return tiled


def test_report_names_sdxl_and_says_what_ran_on_this_cpu(runs):
    (run,) = runs[64].report.runs
    assert run["model_family"] == "SDXL"
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptOffload", "SDOptLowMemory", "SDOptAttention"}
    assert records["SDOptOffload"]["active"] == "no-op" and "CPU" in records["SDOptOffload"]["note"]
    assert records["SDOptLowMemory"]["active"].startswith("budget 512 MiB")
    assert records["SDOptAttention"]["active"] == "sdpa_fused", "PyTorch's CPU flash kernel takes every attention call"
    assert _vae_record(runs[64])["active"].startswith("decode: untiled (fits")
    (forced,) = runs[256].report.runs
    assert [o["active"] for o in forced["optimizations"] if o["node"] == "SDOptLowMemory"][0].startswith("budget 1 MiB")
    tiled = _vae_record(runs[256])
    assert tiled["requested"].startswith("tile=128") and "2x2 = 4 tiles" in tiled["active"], tiled


def _apply(sdxl, class_type, given, widgets):
    node = sdxl.nodes[class_type]
    return getattr(node(), node.FUNCTION)(given, *widgets[class_type])


def test_the_models_it_was_given_are_unchanged(sdxl, prompt_context):
    """The workflow's own node settings, applied in process to the shared checkpoint."""
    nodes = {n["type"]: n["widgets_values"] for n in json.loads((sdxl.WORKFLOWS / WORKFLOW).read_text())["nodes"]}
    model, _, vae = sdxl.load_checkpoint()
    latent = sdxl.sample(model)
    image = vae.decode(latent)
    (offloaded,) = _apply(sdxl, "SDOptOffload", model, nodes)
    (low,) = _apply(sdxl, "SDOptLowMemory", offloaded, nodes)
    (tiled,) = _apply(sdxl, "SDOptTiledVAE", vae, nodes)
    tiled.decode(sdxl.sample(low))
    assert torch.equal(sdxl.sample(model), latent)
    assert torch.equal(vae.decode(latent), image)
