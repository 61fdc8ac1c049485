"""workflows/flux_lowvram.json headless on the Flux mini checkpoint, its CLIP-L text encoder loaded by
the workflow's own Load CLIP: its image equals the same workflow's with every sdopt node bypassed, as
saved at 64x64 (2 steps), and with a 1 MiB Low Memory budget, which slices the double blocks' MLPs, and
the VAE decoded in tiles (128x128, 1 step). The report names Flux and says what each node did on this
CPU (Offload passes through; Low Memory names what a DiT lacks); the model and VAE the workflow's nodes
are given sample and decode as before once the patched copies have run."""
import json

import numpy as np
import pytest
import torch

WORKFLOW = "flux_lowvram.json"
SDOPT_NODES = ("SDOptOffload", "SDOptLowMemory", "SDOptTiledVAE", "SDOptProfiler", "SDOptProfileReport")
MAX_LEVEL_DIFF = 1
FORCE_SLICES = ["SDOptLowMemory.budget_mb=1", "SDOptTiledVAE.tile=64", "SDOptTiledVAE.only_when_needed=false"]


def _size(side, steps=1):
    return [f"KSampler.steps={steps}", f"EmptyLatentImage.width={side}", f"EmptyLatentImage.height={side}"]


@pytest.fixture(scope="module")
def flux(comfy_host):
    return comfy_host.family("flux")


@pytest.fixture(scope="module")
def runs(flux):
    path = flux.WORKFLOWS / WORKFLOW
    stock = flux.bypassed(json.loads(path.read_text()), SDOPT_NODES)
    return {
        "stock 64": flux.run(stock, flux.SMALL),
        64: flux.run(path, flux.SMALL),
        "stock 128": flux.run(stock, _size(128)),
        128: flux.run(path, _size(128) + FORCE_SLICES),
    }


@pytest.mark.parametrize("side", [64, 128])
def test_image_equals_the_workflow_without_sdopt(flux, runs, side):
    stock, patched = flux.image(runs[f"stock {side}"], "flux_lowvram"), flux.image(runs[side], "flux_lowvram")
    assert runs[f"stock {side}"].report is None, "no sdopt node ran"
    assert patched.shape == (side, side, 3)
    assert np.abs(stock - patched).max() <= MAX_LEVEL_DIFF


def test_report_names_flux_and_says_what_ran_on_this_cpu(runs):
    (run,) = runs[64].report.runs
    assert run["model_family"] == "Flux" and run["label"] == "flux low vram"
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptOffload", "SDOptLowMemory", "SDOptAttention"}
    assert records["SDOptOffload"]["active"] == "no-op" and "CPU" in records["SDOptOffload"]["note"]
    assert records["SDOptLowMemory"]["active"].startswith("budget 512 MiB") and "feed-forwards" in records["SDOptLowMemory"]["active"]
    assert "has no GroupNorms" in records["SDOptLowMemory"]["note"]
    (forced,) = runs[128].report.runs
    assert [o["active"] for o in forced["optimizations"] if o["node"] == "SDOptLowMemory"][0].startswith("budget 1 MiB")
    (tiled,) = [o for o in runs[128].report.optimizations if o["node"] == "SDOptTiledVAE"]
    assert "2x2 = 4 tiles" in tiled["active"], tiled


def test_the_models_it_was_given_are_unchanged(flux, prompt_context):
    nodes = {n["type"]: n["widgets_values"] for n in json.loads((flux.WORKFLOWS / WORKFLOW).read_text())["nodes"]}
    model, _, vae = flux.load_checkpoint()
    latent = flux.sample(model)
    image = vae.decode(latent)
    for class_type, given in (("SDOptOffload", model), ("SDOptLowMemory", model), ("SDOptTiledVAE", vae)):
        node = flux.nodes[class_type]
        patched = getattr(node(), node.FUNCTION)(given, *nodes[class_type])[0]
        if class_type == "SDOptTiledVAE":
            patched.decode(latent)
        else:
            flux.sample(patched)
    assert torch.equal(flux.sample(model), latent)
    assert torch.equal(vae.decode(latent), image)
