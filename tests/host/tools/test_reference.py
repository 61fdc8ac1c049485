"""The reference models in the real ComfyUI: ``make-model ref-sd15`` assembles the shipped weights into a
checkpoint that CheckpointLoaderSimple loads as SD1.5, whose block-mean VAE round-trips a scene exactly,
and whose images, sampled at the default settings (20 euler steps), show the captions asked for; every
registered MODEL node at its default settings keeps that accuracy."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from sdopt.families import MODEL_NAMES, UNET_PREFIX, checkpoint_config, family_of_config_class, resolve_model
from sdopt.nodes.registry import NODE_CLASS_MAPPINGS
from sdopt.tools.modelgen import ensure_checkpoint
from sdopt.tools.modelgen.trained import load_trained
from sdopt.tools.reference.evaluate import caption_accuracy, evaluation_set, sample_images
from sdopt.tools.reference.scenes import all_scenes, render

REFERENCE_MODELS = [name for name in MODEL_NAMES if checkpoint_config(name).trained]
# The reference whose images the accuracy checks read: the one that draws its colours (docs/benchmarks.md).
MODEL = "ref-sd15"
# Images per check: enough that 90% means something, few enough for the host tier (about a second each).
IMAGES = 12
# Per node: its accuracy over these may trail stock's by one image at most.
NODE_IMAGES = 4
MODEL_NODES = [name for name, cls in NODE_CLASS_MAPPINGS.items() if cls.RETURN_TYPES == ("MODEL",)]


def _load(comfy_host, name: str):
    import nodes

    family, size = resolve_model(name)
    path = ensure_checkpoint(name, comfy_host.models / family.checkpoint_filename(size))
    return path, nodes.CheckpointLoaderSimple().load_checkpoint(path.name)[:3]


@pytest.fixture(scope="module")
def reference(comfy_host):
    return _load(comfy_host, MODEL)


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
    image = torch.tensor(list(render(all_scenes()[5], 0).getdata()), dtype=torch.float32).reshape(1, 64, 64, 3) / 255
    torch.testing.assert_close(vae.decode(vae.encode(image)), image, atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def stock_accuracy(reference):
    """How stock's images of the evaluation set read: all ``IMAGES``, and the first ``NODE_IMAGES``."""
    _, (model, clip, vae) = reference
    pairs = evaluation_set(IMAGES)
    images = sample_images(model, clip, vae, pairs)
    return caption_accuracy(images, pairs), caption_accuracy(images[:NODE_IMAGES], pairs[:NODE_IMAGES])


def test_stock_images_show_their_colours(stock_accuracy):
    accuracy, _ = stock_accuracy
    assert accuracy["colour"] >= 0.8 and accuracy["background"] >= 0.9, accuracy


@pytest.mark.xfail(strict=True, reason="ref-sd15 draws colours, not yet shapes and quadrants (docs/benchmarks.md, Reference models)")
def test_stock_images_match_their_captions_nine_times_in_ten(stock_accuracy):
    accuracy, _ = stock_accuracy
    assert accuracy["shape_colour"] >= 0.9, accuracy


def _defaults(cls) -> dict:
    """Every widget input of a node class at its default (a list's first entry where it names none)."""
    types = cls.INPUT_TYPES()
    defaults = {}
    for name, spec in {**types["required"], **types.get("optional", {})}.items():
        if name != "model":
            kind, options = spec[0], spec[1] if len(spec) > 1 else {}
            defaults[name] = options.get("default", kind[0] if isinstance(kind, list) else None)
    return defaults


@pytest.mark.parametrize("node", MODEL_NODES)
def test_each_model_node_at_its_defaults_keeps_the_accuracy(comfy_host, reference, stock_accuracy, node):
    _, (model, clip, vae) = reference
    _, stock = stock_accuracy
    cls = comfy_host.nodes[node]
    patched = getattr(cls(), cls.FUNCTION)(model, **_defaults(cls))[0]
    pairs = evaluation_set(IMAGES)[:NODE_IMAGES]
    accuracy = caption_accuracy(sample_images(patched, clip, vae, pairs), pairs)
    for attribute in ("colour", "background", "shape_colour"):
        assert accuracy[attribute] >= stock[attribute] - 1 / NODE_IMAGES, (node, attribute, accuracy, stock)
