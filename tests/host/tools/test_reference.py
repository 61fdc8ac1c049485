"""The reference models in the real ComfyUI: ``make-model ref-<family>`` assembles the shipped weights into
a checkpoint that CheckpointLoaderSimple loads as its family, whose block-mean VAE round-trips a scene
exactly. What their images show is measured by ``bench quality`` (docs/benchmarks.md): sampling enough
images to mean something costs minutes on a CPU, more than the host tier can spend."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from sdopt.families import MODEL_NAMES, UNET_PREFIX, checkpoint_config, family_of_config_class, resolve_model
from sdopt.tools.modelgen import ensure_checkpoint
from sdopt.tools.modelgen.trained import load_trained
from sdopt.tools.reference.classifier import renders
from sdopt.tools.reference.scenes import all_scenes

REFERENCE_MODELS = [name for name in MODEL_NAMES if checkpoint_config(name).trained]


def _load(comfy_host, name: str):
    import nodes

    family, size = resolve_model(name)
    path = ensure_checkpoint(name, comfy_host.models / family.checkpoint_filename(size))
    return path, nodes.CheckpointLoaderSimple().load_checkpoint(path.name)[:3]


@pytest.fixture(scope="module", params=REFERENCE_MODELS)
def each_reference(request, comfy_host):
    return request.param, *_load(comfy_host, request.param)


def test_the_checkpoint_holds_the_shipped_weights(each_reference):
    name, path, _ = each_reference
    shipped = load_trained(name)
    with safe_open(str(path), "pt") as file:
        written = {key.removeprefix(UNET_PREFIX): file.get_tensor(key) for key in file.keys() if key.startswith(UNET_PREFIX)}
    assert written.keys() == shipped.keys()
    assert all(torch.equal(written[key], shipped[key].half()) for key in shipped)


def test_comfyui_loads_it_as_its_family_and_its_vae_round_trips_a_scene(each_reference):
    name, _, (model, _, vae) = each_reference
    assert family_of_config_class(type(model.model.model_config)) is resolve_model(name)[0]
    image = renders([all_scenes()[5]], [0]).movedim(1, -1)
    torch.testing.assert_close(vae.decode(vae.encode(image)), image, atol=1e-3, rtol=0)
