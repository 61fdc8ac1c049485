"""tools.modelgen in the real ComfyUI: each family's mini checkpoint is detected as its family, loads
every key (UNet, text encoders, VAE) with none missing or left over, samples, and the SDXL VAE
overflows fp16 as the real one does; make-lora's LoRA is applied whole and changes the image with its
strength; the unit tier's fixture of ComfyUI's detection is current."""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path

import torch

from sdopt.families import UNET_PREFIX, family_of_config_class, resolve_model
from sdopt.tools.modelgen import write_lora

# What ComfyUI builds but SD1.5 and SDXL files, real ones included, never carry, and so filters from
# its "clip missing" warning (comfy/sd.py): CLIP-L's projection and temperature.
CLIP_UNSET = {"clip_l.logit_scale", "clip_l.transformer.text_projection.weight"}
MANIFEST_FIXTURES = Path(__file__).resolve().parents[2] / "unit" / "tools" / "fixtures"


def _strip(keys, prefix: str) -> set[str]:
    return {key[len(prefix):] for key in keys if key.startswith(prefix)}


def test_checkpoint_loader_detects_the_family(family_host):
    import comfy.model_base
    import comfy.supported_models

    model = family_host.load_checkpoint()[0]
    config = model.model.model_config
    assert family_of_config_class(type(config)) is family_host.model_family
    if family_host.model_family.name == "sdxl":
        assert isinstance(config, comfy.supported_models.SDXL)
        assert isinstance(model.model, comfy.model_base.SDXL)


def test_every_key_of_the_file_is_loaded_and_nothing_is_missing(family_host):
    model, clip, vae = family_host.load_checkpoint()
    shapes = family_host.file_shapes(family_host.checkpoint)
    vae_prefix = family_host.model_family.sizes["mini"].vae_prefix
    # through ComfyUI's own renaming on load (newer ComfyUIs name Flux's RMSNorm scales ``weight``)
    in_file = {key: torch.empty(shapes[UNET_PREFIX + key], device="meta") for key in _strip(shapes, UNET_PREFIX)}
    assert set(model.model.diffusion_model.state_dict()) == set(model.model.model_config.process_unet_state_dict(in_file))
    assert set(vae.first_stage_model.state_dict()) == _strip(shapes, vae_prefix)
    built = clip.cond_stage_model.state_dict()

    text_file = family_host.model_family.text_encoder_filename("mini")
    if text_file:
        # Flux: no text encoder in the checkpoint; CLIPLoader built CLIP-L from its own file, whose
        # keys sit under the built encoder's ``transformer.``.
        assert set(shapes) == {key for key in shapes if key.startswith((UNET_PREFIX, vae_prefix))}
        separate = family_host.file_shapes(family_host.models / "text_encoders" / text_file)
        (prefix,) = {key[: -len(name)] for key in built for name in separate if key.endswith("transformer." + name)}
        assert set(built) - {prefix + key for key in separate} <= CLIP_UNSET
        assert all(list(built[prefix + key].shape) == list(shape) for key, shape in separate.items())
        return

    # ComfyUI's own conversion of the file's text encoder keys (on meta tensors: OpenCLIP's fused
    # q/k/v are split by slicing), against the modules it built.
    text = {
        key: torch.empty(shape, device="meta")
        for key, shape in shapes.items()
        if not key.startswith((UNET_PREFIX, vae_prefix))
    }
    converted = model.model.model_config.process_clip_state_dict(text)
    assert set(converted) <= set(built)
    assert set(built) - set(converted) <= CLIP_UNSET
    assert {key: value.shape for key, value in converted.items()} == {key: built[key].shape for key in converted}


def test_sdxl_conditioning_and_sampling(comfy_host):
    import nodes

    sdxl = comfy_host.family("sdxl")
    clip = sdxl.load_checkpoint()[1]
    (cond, extra), = nodes.CLIPTextEncode().encode(clip, "a lighthouse on a cliff")[0]
    assert cond.shape == (1, 77, 768 + 1280)  # CLIP-L and CLIP-G hidden states side by side
    assert extra["pooled_output"].shape == (1, 1280)
    latent = sdxl.sample(sdxl.load_checkpoint()[0])
    assert latent.shape == (1, 4, 8, 8)
    assert torch.isfinite(latent).all()


def test_sdxl_vae_overflows_fp16_but_not_fp32(comfy_host):
    vae = comfy_host.family("sdxl").load_checkpoint()[2]
    # A 2x2 latent (16 px) keeps the fp16 decode, slow on a CPU, to seconds; the overflow sits in the
    # decoder's middle block, at latent resolution.
    latent = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    decoder = vae.first_stage_model
    with torch.no_grad():
        full = decoder.decode(latent.to(next(decoder.parameters()).dtype))
        half = copy.deepcopy(decoder).half().decode(latent.half())
    assert torch.isfinite(full).all()
    assert not torch.isfinite(half).all()


def test_the_unit_tier_s_comfyui_manifest_is_current(comfy_host):
    script = MANIFEST_FIXTURES / "comfyui_manifest.py"
    spec = importlib.util.spec_from_file_location("comfyui_manifest", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((MANIFEST_FIXTURES / "comfyui_manifest.json").read_text())
    detected = module.comfyui_manifest()
    unloadable = {name for name in committed if comfy_host.view(resolve_model(name)[0].name).unloadable_reason}
    # A ComfyUI that cannot load a family's minis (conftest's unloadable_reason) detects them otherwise.
    for name in unloadable:
        committed.pop(name), detected.pop(name, None)
    for name, entry in detected.items():
        # A newer ComfyUI's detection adds config keys of its own (0.33: Flux's txt_norm, yak_mlp, txt_ids_dims);
        # what the fixture holds must still hold.
        held = committed.get(name, {}).get("detected", {})
        entry["detected"] = {key: value for key, value in entry["detected"].items() if key in held}
    assert detected == committed, f"stale fixture: regenerate it as {script} says"


def test_make_lora_is_applied_whole_and_the_image_follows_its_strength(family_host, tmp_path, caplog):
    import comfy.sd
    import comfy.utils

    path = write_lora(family_host.model_family.model_name("mini"), tmp_path / "lora.safetensors", rank=4).path
    lora = comfy.utils.load_torch_file(str(path))
    model, clip, _ = family_host.load_checkpoint()
    with caplog.at_level(logging.WARNING):
        patched = {strength: comfy.sd.load_lora_for_models(model, clip, lora, strength, strength) for strength in (1.0, 0.5)}
    assert [r.getMessage() for r in caplog.records if "lora key not loaded" in r.getMessage()] == []
    layers = {key.removesuffix(".alpha") for key in lora if key.endswith(".alpha")}
    unet_layers = {layer for layer in layers if layer.startswith(("lora_unet_", "diffusion_model."))}
    full_model, full_clip = patched[1.0]
    assert len(full_model.patches) == len(unet_layers) > 0
    # Flux's text encoder lives in a file of its own, which the LoRA leaves alone
    in_checkpoint = bool(family_host.model_family.sizes["mini"].text_encoders)
    assert len(full_clip.patcher.patches) == len(layers - unet_layers) and (len(layers - unet_layers) > 0) == in_checkpoint

    base, full, half = (family_host.sample(m) for m in (model, full_model, patched[0.5][0]))
    assert torch.isfinite(full).all() and torch.isfinite(half).all()
    for first, second in ((base, half), (half, full), (base, full)):
        assert not torch.allclose(first, second, rtol=1e-3, atol=1e-3)
