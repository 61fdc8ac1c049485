"""The reference models in the real ComfyUI: ``make-model ref-<family>`` assembles the shipped weights into
a checkpoint that CheckpointLoaderSimple loads as its family, whose block-mean VAE round-trips a scene
exactly, and ``ref-sd15``'s images, read by the classifier, draw the colours their captions ask for, with
and without Step Cache at its defaults: a test that sees the image. The full accuracy table per setting is
``bench quality``'s (docs/benchmarks.md): enough images per setting cost minutes on a CPU."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from sdopt.families import MODEL_NAMES, UNET_PREFIX, checkpoint_config, family_of_config_class, resolve_model
from sdopt.tools.modelgen import ensure_checkpoint
from sdopt.tools.modelgen.trained import load_trained
from sdopt.tools.reference.classifier import renders
from sdopt.tools.bench_quality import ModelCallCounter, image_distance
from sdopt.tools.reference.evaluate import Sampling, caption_accuracy, evaluation_set, sample_images
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


def _defaults(node) -> list:
    """A node's required widget values at their defaults, in its function's order."""
    values = []
    for kind, options in list(node.INPUT_TYPES()["required"].values())[1:]:
        values.append(options["default"] if "default" in options else kind[0])
    return values


@torch.inference_mode()
def test_ref_sd15_draws_its_captions_colours_stock_and_through_step_cache_at_its_defaults(comfy_host):
    """16 pairs at the reference settings (20 euler steps, CFG 5): on the 64 pairs of bench quality's set the
    model reads right for colour and background 100% of the time and for shape 67% (docs/benchmarks.md)."""
    _, (model, clip, vae) = _load(comfy_host, "ref-sd15")
    cache = comfy_host.nodes["SDOptStepCache"]()
    cached = cache.patch(model, *_defaults(cache))[0]
    pairs = evaluation_set(16)
    for patched in (model, cached):
        accuracy = caption_accuracy(sample_images(patched, clip, vae, pairs), pairs)
        assert accuracy["colour"] >= 0.9 and accuracy["background"] >= 0.9, accuracy
        assert accuracy["shape_colour"] >= 0.5, accuracy


@torch.inference_mode()
def test_first_block_cache_at_its_defaults_skips_a_third_of_ref_sd35s_calls_and_keeps_its_images(comfy_host):
    """The trained MMDiT, where First Block Cache's threshold means something (on random weights it skipped
    nothing): 16 pairs at the reference settings, counted as bench quality counts model calls."""
    _, (model, clip, vae) = _load(comfy_host, "ref-sd35")
    cache = comfy_host.nodes["SDOptStepCache"]()
    values = _defaults(cache)
    values[0] = "first_block"
    cached = cache.patch(model, *values)[0]
    pairs = evaluation_set(16)
    stock = sample_images(model, clip, vae, pairs)
    with ModelCallCounter(cached.model.diffusion_model) as counter:
        images = sample_images(cached, clip, vae, pairs)
    calls = counter.calls / len(pairs)
    assert calls <= 0.7 * Sampling().steps, f"{calls:.1f} model calls per image of {Sampling().steps}"
    psnr, _ = image_distance(images, stock)
    assert psnr >= 25.0, psnr
    read_stock, read_cached = caption_accuracy(stock, pairs), caption_accuracy(images, pairs)
    assert read_cached["colour"] >= read_stock["colour"] - 2 / len(pairs), (read_stock, read_cached)
