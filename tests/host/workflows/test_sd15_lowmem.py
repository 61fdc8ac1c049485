"""workflows/sd15_lowmem.json headless on the mini checkpoint: it completes at 512 (one step, to stay
fast on a CPU; a 1024 run, which exercises no path 512 does not, made most of this module's four
minutes in CI); at the baseline's 64x64 its image matches the baseline's (the low-memory UNet is exact
to float rounding, the tiled VAE decodes untiled when the image fits); the report says what each node
did on this CPU; and the model and VAE the workflow's nodes are given sample and decode as before once
the patched copies have run."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

WORKFLOW = "sd15_lowmem.json"
# sub_quadratic attention differs from ComfyUI's CPU attention by float rounding (~1e-5 relative).
MAX_LEVEL_DIFF = 1


def _size(side, steps=1):
    return [f"KSampler.steps={steps}", f"EmptyLatentImage.width={side}", f"EmptyLatentImage.height={side}"]


def _image(outcome, prefix):
    (path,) = [p for p in outcome.images if p.name.startswith(prefix)]
    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.fixture(scope="module")
def runs(comfy_host):
    workflow = comfy_host.WORKFLOWS / WORKFLOW
    return {
        "baseline": comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", comfy_host.SMALL),
        64: comfy_host.run(workflow, comfy_host.SMALL),
        512: comfy_host.run(workflow, _size(512)),
    }


@pytest.mark.parametrize("side", [512])
def test_it_completes(runs, side):
    (run,) = runs[side].report.runs
    assert run["label"] == "low memory" and len(run["steps"]) == 1
    assert _image(runs[side], "lowmem").shape == (side, side, 3)


def test_image_matches_the_baseline(runs):
    difference = np.abs(_image(runs["baseline"], "baseline") - _image(runs[64], "lowmem"))
    assert difference.max() <= MAX_LEVEL_DIFF


def test_report_says_what_ran_on_this_cpu(runs):
    (run,) = runs[512].report.runs
    records = {o["node"]: o for o in run["optimizations"]}
    assert set(records) == {"SDOptOffload", "SDOptLowMemory", "SDOptAttention"}
    assert records["SDOptOffload"]["active"] == "no-op" and "CPU" in records["SDOptOffload"]["note"]
    assert records["SDOptLowMemory"]["active"].startswith("budget 256 MiB")
    (tiled,) = [o for o in runs[512].report.optimizations if o["node"] == "SDOptTiledVAE"]
    assert tiled["requested"].startswith("tile=auto")


def _apply(comfy_host, class_type, given, widgets):
    node = comfy_host.nodes[class_type]
    return getattr(node(), node.FUNCTION)(given, *widgets[class_type])


def test_the_models_it_was_given_are_unchanged(comfy_host, prompt_context):
    """The workflow's own node settings, applied in process to the shared checkpoint."""
    nodes = {n["type"]: n["widgets_values"] for n in json.loads((comfy_host.WORKFLOWS / WORKFLOW).read_text())["nodes"]}
    model, _, vae = comfy_host.load_checkpoint()
    latent = comfy_host.sample(model)
    image = vae.decode(latent)
    (offloaded,) = _apply(comfy_host, "SDOptOffload", model, nodes)
    (low,) = _apply(comfy_host, "SDOptLowMemory", offloaded, nodes)
    (tiled,) = _apply(comfy_host, "SDOptTiledVAE", vae, nodes)
    tiled.decode(comfy_host.sample(low))
    assert torch.equal(comfy_host.sample(model), latent)
    assert torch.equal(vae.decode(latent), image)
