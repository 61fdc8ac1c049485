"""tools.modelgen: determinism, the LDM key layout (checked by diffusers' own converters), manifests, the
SDXL checkpoint against ComfyUI's detection (a committed fixture) and its fp16-overflowing VAE, CLI."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
    create_unet_diffusers_config_from_ldm,
    create_vae_diffusers_config_from_ldm,
)
from safetensors import safe_open
from safetensors.torch import load_file

from sdopt.errors import UserError
from sdopt.families import (
    FAMILIES,
    MODEL_NAMES,
    UNET_PREFIX,
    VAE_PREFIX,
    MMDiTConfig,
    UNetConfig,
    checkpoint_config,
    resolve_model,
)
from sdopt.tools import cli, modelgen
from sdopt.tools.modelgen import (
    checkpoint_specs,
    clip_text_specs,
    diffusion_model_specs,
    ensure_checkpoint,
    separate_text_encoder_specs,
    text_encoder_path,
    diffusers_diffusion_model,
    diffusers_unet_config,
    diffusers_vae_config,
    lora_specs,
    param_count,
    text_encoder_specs,
    transformers_clip_text_config,
    unet_ldm_specs,
    vae_ldm_specs,
    write_checkpoint,
    write_lora,
)

TEXT_ENCODER_PREFIX = FAMILIES["sd15"].sizes["full"].text_encoders[0].prefix
SDXL = FAMILIES["sdxl"]
UNET_MODEL_NAMES = [name for name in MODEL_NAMES if isinstance(checkpoint_config(name).diffusion_model, UNetConfig)]
CLIP_L, CLIP_G = SDXL.sizes["full"].text_encoders
CLIP_G_TINY = SDXL.sizes["tiny"].text_encoders[1]
# What ComfyUI 0.3.75's own model detection makes of the SDXL checkpoints; regenerate with the command in
# fixtures/comfyui_manifest.py (the host tier fails when it is stale).
COMFYUI_MANIFEST = json.loads((Path(__file__).parent / "fixtures" / "comfyui_manifest.json").read_text())
# ComfyUI 0.3.64's own SD1.5 classes give these (docs: comfyui-host-notes.md, section I).
SD15_TENSORS_AND_PARAMS = {
    UNET_PREFIX: (686, 859_520_964),
    TEXT_ENCODER_PREFIX: (196, 123_060_480),
    VAE_PREFIX: (248, 83_653_863),
}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("tiny") / "tiny.safetensors"
    write_checkpoint("tiny", path, seed=0, dtype="fp32")
    return load_file(path)


def _part(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state_dict.items() if key.startswith(prefix)}


def _ldm_original_config(size: str) -> dict:
    """The LDM yaml (v1-inference.yaml layout) that the sdopt config stands for."""
    cfg = checkpoint_config(size)
    unet, vae = cfg.diffusion_model, cfg.vae
    return {
        "model": {
            "params": {
                "scale_factor": FAMILIES["sd15"].latent.scale,
                "unet_config": {
                    "params": {
                        "in_channels": unet.in_channels,
                        "out_channels": unet.out_channels,
                        "model_channels": unet.model_channels,
                        "attention_resolutions": [2**level for level, depth in enumerate(unet.transformer_depth) if depth],
                        "num_res_blocks": unet.num_res_blocks,
                        "channel_mult": list(unet.channel_mult),
                        "num_heads": unet.num_heads,
                        "transformer_depth": 1,
                        "context_dim": unet.context_dim,
                        "use_linear_in_transformer": False,
                    }
                },
                "first_stage_config": {
                    "params": {
                        "ddconfig": {
                            "double_z": True,
                            "z_channels": vae.z_channels,
                            "in_channels": vae.in_channels,
                            "out_ch": vae.out_channels,
                            "ch": vae.ch,
                            "ch_mult": list(vae.ch_mult),
                            "num_res_blocks": vae.num_res_blocks,
                            "attn_resolutions": [],
                        }
                    }
                },
            }
        }
    }


# --- determinism -----------------------------------------------------------------------------


def test_same_seed_gives_identical_tensors_and_another_seed_differs(tmp_path):
    paths = {name: tmp_path / f"{name}.safetensors" for name in ("a", "b", "other")}
    write_checkpoint("tiny", paths["a"], seed=7)
    write_checkpoint("tiny", paths["b"], seed=7)
    write_checkpoint("tiny", paths["other"], seed=8)
    first, second, other = (load_file(paths[name]) for name in ("a", "b", "other"))

    assert first.keys() == second.keys() == other.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
        assert not torch.equal(first[key], other[key]), key
    assert paths["a"].read_bytes() == paths["b"].read_bytes()


def test_tensor_depends_only_on_seed_and_key_and_fp16_is_fp32_cast(tmp_path, tiny_checkpoint):
    fp16 = load_file(write_checkpoint("tiny", tmp_path / "half.safetensors", seed=0, dtype="fp16").path)
    specs = checkpoint_specs("tiny")
    for key in (UNET_PREFIX + "out.2.weight", VAE_PREFIX + "decoder.conv_in.bias"):
        assert torch.equal(modelgen.generate_tensor(key, specs[key], seed=0), tiny_checkpoint[key])
    for key, value in fp16.items():
        assert value.dtype == torch.float16
        assert torch.equal(value, tiny_checkpoint[key].half()), key


def test_initialisation_is_scaled_by_kind(tiny_checkpoint):
    norm_scale = tiny_checkpoint[UNET_PREFIX + "out.0.weight"]
    conv = tiny_checkpoint[UNET_PREFIX + "input_blocks.1.0.in_layers.2.weight"]  # fan_in 32 * 3 * 3
    assert torch.all((norm_scale - 1).abs() < 0.2)
    assert conv.std().item() == pytest.approx((32 * 9) ** -0.5, rel=0.1)
    assert all(torch.isfinite(value).all() for value in tiny_checkpoint.values())


def test_metadata_and_summary(tmp_path):
    summary = write_checkpoint("tiny", tmp_path / "nested" / "dir" / "m.safetensors", seed=3)
    assert summary.path.is_file()
    assert summary.file_bytes == summary.path.stat().st_size
    assert summary.param_count == param_count(checkpoint_specs("tiny"))
    with safe_open(str(summary.path), "pt") as file:
        assert file.metadata() == {"format": "pt", "sdopt_size": "tiny", "sdopt_seed": "3", "sdopt_dtype": "fp16"}
        assert len(list(file.keys())) == summary.tensor_count


# --- key layout, checked against diffusers' LDM single-file converters -----------------------


def test_diffusers_configs_agree_with_diffusers_reading_of_the_ldm_config():
    # sample_size is left out: diffusers guesses it (512 px) from the checkpoint type, and passing
    # image_size is deprecated; it only sets a default resolution, not the structure.
    for size in ("tiny", "mini", "full"):
        original = _ldm_original_config(size)
        for ours, theirs in (
            (diffusers_unet_config(size), create_unet_diffusers_config_from_ldm(original, {})),
            (diffusers_vae_config(size), create_vae_diffusers_config_from_ldm(original, {})),
        ):
            del ours["sample_size"]
            assert ours == {key: theirs[key] for key in ours}, size


def test_tiny_unet_keys_load_strictly_into_diffusers(tiny_checkpoint):
    config = diffusers_unet_config("tiny")
    ldm = _part(tiny_checkpoint, UNET_PREFIX)
    converted = convert_ldm_unet_checkpoint(checkpoint=tiny_checkpoint, config=config)
    # The converter silently drops keys it does not know, so count them: one diffusers key per LDM key.
    assert len(converted) == len(ldm)
    unet = UNet2DConditionModel(**config).eval()
    unet.load_state_dict(converted, strict=True)

    latent_side = config["sample_size"]
    context = torch.randn(1, 77, config["cross_attention_dim"])
    with torch.no_grad():
        out = unet(torch.randn(1, 4, latent_side, latent_side), 500, encoder_hidden_states=context).sample
    assert out.shape == (1, 4, latent_side, latent_side)
    assert torch.isfinite(out).all()


def test_tiny_vae_keys_load_strictly_into_diffusers(tiny_checkpoint):
    config = diffusers_vae_config("tiny")
    ldm = _part(tiny_checkpoint, VAE_PREFIX)
    converted = convert_ldm_vae_checkpoint(checkpoint=tiny_checkpoint, config=config)
    assert len(converted) == len(ldm)
    vae = AutoencoderKL(**config).eval()
    vae.load_state_dict(converted, strict=True)

    with torch.no_grad():
        image = vae.decode(torch.randn(1, 4, 8, 8)).sample
    assert image.shape == (1, 3, 8 * checkpoint_config("tiny").vae.downscale, 16)
    assert torch.isfinite(image).all()


def test_tiny_text_encoder_keys_load_into_transformers(tiny_checkpoint):
    transformers = pytest.importorskip("transformers", reason="transformers not installed: text encoder unchecked")
    converted = convert_ldm_clip_checkpoint(tiny_checkpoint)
    assert len(converted) == len(_part(tiny_checkpoint, TEXT_ENCODER_PREFIX))
    model = transformers.CLIPTextModel(transformers.CLIPTextConfig(**transformers_clip_text_config("tiny"))).eval()
    if not hasattr(model, "text_model"):
        # transformers >= 5.6 flattened CLIPTextModel; diffusers strips the prefix the same way.
        converted = {key.removeprefix("text_model."): value for key, value in converted.items()}
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert unexpected == []
    # Older transformers kept position_ids as a persistent buffer; SD1.5 files need not carry it.
    assert {key.removeprefix("text_model.") for key in missing} <= {"embeddings.position_ids"}

    with torch.no_grad():
        hidden = model(torch.tensor([[49406, 320, 1929, 49407]])).last_hidden_state
    assert torch.isfinite(hidden).all()


# --- manifests -------------------------------------------------------------------------------


def test_full_manifest_matches_sd15_exactly():
    specs = checkpoint_specs("full")
    for prefix, (tensors, params) in SD15_TENSORS_AND_PARAMS.items():
        part = {key: spec for key, spec in specs.items() if key.startswith(prefix)}
        assert (len(part), param_count(part)) == (tensors, params), prefix
    assert len(specs) == sum(tensors for tensors, _ in SD15_TENSORS_AND_PARAMS.values())
    assert specs[VAE_PREFIX + "decoder.conv_in.weight"].shape == (512, 4, 3, 3)
    assert specs[VAE_PREFIX + "quant_conv.weight"].shape == (8, 8, 1, 1)
    assert specs[VAE_PREFIX + "post_quant_conv.weight"].shape == (4, 4, 1, 1)


def test_mini_manifest_is_detected_as_sd15_with_full_text_encoder_and_vae():
    mini = checkpoint_config("mini")
    full = checkpoint_config("full")
    unet = unet_ldm_specs(mini.diffusion_model)
    assert param_count(unet) == 107_431_044
    # What ComfyUI's SD15.matches reads: model_channels 320, in_channels 4, context 768, conv proj_in.
    assert unet["input_blocks.0.0.weight"].shape == (320, 4, 3, 3)
    assert unet["input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"].shape == (320, 768)
    assert len(unet["input_blocks.1.1.proj_in.weight"].shape) == 4
    assert "label_emb.0.0.weight" not in unet
    assert mini.text_encoders == full.text_encoders
    assert clip_text_specs(mini.text_encoders[0]) == clip_text_specs(full.text_encoders[0])
    assert vae_ldm_specs(mini.vae) == vae_ldm_specs(full.vae)


# --- SDXL ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl_tiny_checkpoint(tmp_path_factory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("sdxl-tiny") / "sdxl-tiny.safetensors"
    write_checkpoint("sdxl-tiny", path, seed=0, dtype="fp32")
    return load_file(path)


def _sgm_original_config(name: str) -> dict:
    """The generative-models yaml (sd_xl_base.yaml layout) that the sdopt config stands for."""
    cfg = checkpoint_config(name)
    unet, vae = cfg.diffusion_model, cfg.vae
    return {
        "model": {
            "params": {
                "scale_factor": SDXL.latent.scale,
                "network_config": {
                    "params": {
                        "adm_in_channels": unet.adm_in_channels,
                        "num_classes": "sequential",
                        "in_channels": unet.in_channels,
                        "out_channels": unet.out_channels,
                        "model_channels": unet.model_channels,
                        "attention_resolutions": [2**level for level, depth in enumerate(unet.transformer_depth) if depth],
                        "num_res_blocks": unet.num_res_blocks,
                        "channel_mult": list(unet.channel_mult),
                        "num_head_channels": unet.num_head_channels,
                        "use_linear_in_transformer": True,
                        "transformer_depth": list(unet.transformer_depth),
                        "context_dim": unet.context_dim,
                    }
                },
                "first_stage_config": {
                    "params": {
                        "ddconfig": {
                            "double_z": True,
                            "z_channels": vae.z_channels,
                            "in_channels": vae.in_channels,
                            "out_ch": vae.out_channels,
                            "ch": vae.ch,
                            "ch_mult": list(vae.ch_mult),
                            "num_res_blocks": vae.num_res_blocks,
                            "attn_resolutions": [],
                        }
                    }
                },
            }
        }
    }


@pytest.mark.parametrize("name", ["sdxl-mini", "sdxl-full"])
def test_sdxl_diffusers_configs_agree_with_diffusers_reading_of_the_sgm_config(name):
    # diffusers' reader knows SDXL by its context width, so tiny (64) is checked by loading it below.
    original = _sgm_original_config(name)
    for ours, theirs in (
        (diffusers_unet_config(name), create_unet_diffusers_config_from_ldm(original, {})),
        (diffusers_vae_config(name), create_vae_diffusers_config_from_ldm(original, {})),
    ):
        del ours["sample_size"]
        # The yaml has no output-side depths: mini's lighter output blocks are ours alone.
        assert set(ours) - set(theirs) <= {"reverse_transformer_layers_per_block"}, name
        assert {key: ours[key] for key in theirs.keys() & ours.keys()} == {
            key: theirs[key] for key in theirs.keys() & ours.keys()
        }, name
    assert diffusers_unet_config(name)["addition_time_embed_dim"] == 256


# ref-sd15's deepest level has attention in one of its two output blocks, which diffusers cannot build.
DIFFUSERS_UNET_NAMES = [name for name in UNET_MODEL_NAMES if name != "ref-sd15"]


@pytest.mark.parametrize("name", DIFFUSERS_UNET_NAMES)
def test_diffusers_and_transformers_build_every_part_with_the_checkpoint_s_tensors(name):
    """Built on the meta device from our configs, each part has the generated part's tensor and
    parameter counts, so plan and benches model the same networks as the checkpoints."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed: text encoders unchecked")
    cfg = checkpoint_config(name)
    with torch.device("meta"):
        unet = UNet2DConditionModel(**diffusers_unet_config(name))
        vae = AutoencoderKL(**diffusers_vae_config(name))
        texts = [
            (transformers.CLIPTextModelWithProjection if text.projection_dim else transformers.CLIPTextModel)(
                transformers.CLIPTextConfig(**transformers_clip_text_config(name, index))
            )
            for index, text in enumerate(cfg.text_encoders)
        ]
    for module, specs in [(unet, unet_ldm_specs(cfg.diffusion_model)), (vae, vae_ldm_specs(cfg.vae))]:
        assert len(list(module.parameters())) == len(specs), (name, type(module).__name__)
        assert sum(p.numel() for p in module.parameters()) == param_count(specs), (name, type(module).__name__)
    for module, text in zip(texts, cfg.text_encoders):
        # OpenCLIP keeps q, k, v in one tensor and its temperature (unused by SD) as a parameter.
        specs = {key: spec for key, spec in text_encoder_specs(text).items() if key != "logit_scale"}
        assert sum(p.numel() for p in module.parameters()) == param_count(specs), (name, text.prefix)


def test_sdxl_tiny_unet_loads_strictly_into_diffusers_and_runs_with_its_y_vector(sdxl_tiny_checkpoint):
    config = diffusers_unet_config("sdxl-tiny")
    assert config["addition_embed_type"] == "text_time"
    converted = convert_ldm_unet_checkpoint(checkpoint=sdxl_tiny_checkpoint, config=config)
    assert len(converted) == len(_part(sdxl_tiny_checkpoint, UNET_PREFIX))
    unet = UNet2DConditionModel(**config).eval()
    unet.load_state_dict(converted, strict=True)

    side = config["sample_size"]
    pooled = CLIP_G_TINY.projection_dim
    added = {"text_embeds": torch.randn(1, pooled), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
    assert pooled + 6 * config["addition_time_embed_dim"] == checkpoint_config("sdxl-tiny").diffusion_model.adm_in_channels
    with torch.no_grad():
        out = unet(torch.randn(1, 4, side, side), 500, encoder_hidden_states=torch.randn(1, 77, 64), added_cond_kwargs=added)
    assert out.sample.shape == (1, 4, side, side)
    assert torch.isfinite(out.sample).all()


def test_sdxl_tiny_text_encoders_load_into_transformers(sdxl_tiny_checkpoint):
    transformers = pytest.importorskip("transformers", reason="transformers not installed: text encoders unchecked")
    tokens = torch.tensor([[49406, 320, 1929, 49407]])

    clip_l = transformers.CLIPTextModel(transformers.CLIPTextConfig(**transformers_clip_text_config("sdxl-tiny", 0)))
    converted = convert_ldm_clip_checkpoint(sdxl_tiny_checkpoint)
    assert len(converted) == len(_part(sdxl_tiny_checkpoint, CLIP_L.prefix))
    if not hasattr(clip_l, "text_model"):
        converted = {key.removeprefix("text_model."): value for key, value in converted.items()}
    missing, unexpected = clip_l.eval().load_state_dict(converted, strict=False)
    assert unexpected == [] and {key.removeprefix("text_model.") for key in missing} <= {"embeddings.position_ids"}

    config = transformers.CLIPTextConfig(**transformers_clip_text_config("sdxl-tiny", 1))
    assert config.hidden_act == "gelu"
    clip_g = transformers.CLIPTextModelWithProjection(config).eval()
    converted = convert_open_clip_checkpoint(clip_g, sdxl_tiny_checkpoint, prefix=CLIP_G.prefix)
    missing, unexpected = clip_g.load_state_dict(converted, strict=False)
    assert unexpected == [] and {key.removeprefix("text_model.") for key in missing} <= {"embeddings.position_ids"}
    # The projection is stored (hidden, projection) and applied as x @ W: transformers' weight is its transpose.
    stored = sdxl_tiny_checkpoint[CLIP_G.prefix + "text_projection"]
    assert torch.equal(clip_g.text_projection.weight, stored.T)

    with torch.no_grad():
        hidden = clip_l(tokens).last_hidden_state
        projected = clip_g(tokens).text_embeds
    assert torch.isfinite(hidden).all() and torch.isfinite(projected).all()
    assert projected.shape == (1, CLIP_G_TINY.projection_dim)


def _tiny_vae(checkpoint: dict[str, torch.Tensor], name: str) -> AutoencoderKL:
    config = diffusers_vae_config(name)
    vae = AutoencoderKL(**config).eval()
    vae.load_state_dict(convert_ldm_vae_checkpoint(checkpoint=checkpoint, config=config), strict=True)
    return vae


def test_sdxl_vae_overflows_fp16_and_decodes_as_unscaled_in_fp32_and_bf16(sdxl_tiny_checkpoint):
    overflowing = _tiny_vae(sdxl_tiny_checkpoint, "sdxl-tiny")
    # The same VAE with the scaled conv scaled back: what the decoder computes without the overflow.
    scaled = {VAE_PREFIX + modelgen.FP16_OVERFLOW_CONV + suffix for suffix in (".weight", ".bias")}
    plain_weights = {
        key: value / modelgen.FP16_OVERFLOW_SCALE if key in scaled else value for key, value in sdxl_tiny_checkpoint.items()
    }
    plain = _tiny_vae(plain_weights, "sdxl-tiny")
    assert sdxl_tiny_checkpoint[next(iter(scaled))].abs().max() > 100  # the file really holds the large conv

    latent = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = plain.decode(latent).sample
        full = overflowing.decode(latent).sample
        bf16 = overflowing.to(torch.bfloat16).decode(latent.bfloat16()).sample.float()
        plain_bf16 = plain.to(torch.bfloat16).decode(latent.bfloat16()).sample.float()
        half = overflowing.half().decode(latent.half()).sample
        plain_half = plain.half().decode(latent.half()).sample
    torch.testing.assert_close(full, reference, rtol=1e-4, atol=1e-4)
    # bf16 rounds both alike: the scaled one is as close to fp32 as the plain one.
    assert (bf16 - reference).abs().max() <= 2 * (plain_bf16 - reference).abs().max() + 1e-3
    assert torch.isfinite(plain_half).all()
    assert not torch.isfinite(half).all()


def test_sdxl_tiny_unet_has_the_keys_and_shapes_comfyui_builds_from_its_detection():
    expected = {key: tuple(shape) for key, shape in COMFYUI_MANIFEST["sdxl-tiny"]["unet"].items()}
    assert {key: spec.shape for key, spec in unet_ldm_specs(checkpoint_config("sdxl-tiny").diffusion_model).items()} == expected


@pytest.mark.parametrize("name", ["sdxl-tiny", "sdxl-mini", "sdxl-full"])
def test_sdxl_configs_are_what_comfyui_detects(name):
    """Our UNet config, spelled out per block the way ComfyUI's detect_unet_config reads a file, is what
    it read from the generated keys; mini and full match ComfyUI's SDXL and have its UNet's size."""
    unet = checkpoint_config(name).diffusion_model
    comfy = COMFYUI_MANIFEST[name]
    per_block = {
        "model_channels": unet.model_channels,
        "channel_mult": list(unet.channel_mult),
        "num_res_blocks": [unet.num_res_blocks] * len(unet.channel_mult),
        "transformer_depth": [depth for depth in unet.transformer_depth for _ in range(unet.num_res_blocks)],
        "transformer_depth_output": list(unet.output_block_depths),
        "transformer_depth_middle": unet.transformer_depth_middle,
        "context_dim": unet.context_dim,
        "use_linear_in_transformer": unet.use_linear_in_transformer,
        "adm_in_channels": unet.adm_in_channels,
        "in_channels": unet.in_channels,
        "out_channels": unet.out_channels,
    }
    assert {key: comfy["detected"][key] for key in per_block} == per_block
    specs = unet_ldm_specs(unet)
    assert (len(specs), param_count(specs)) == (comfy["unet_tensors"], comfy["unet_parameters"])
    if name == "sdxl-tiny":
        assert comfy["supported_model"] is None  # toy widths: not loadable by ComfyUI
    else:
        assert comfy["supported_model"] in SDXL.comfy_configs


def test_sdxl_full_manifest_has_sdxl_s_sizes_and_mini_keeps_the_full_text_encoders_and_vae():
    full, mini = (checkpoint_specs(name) for name in ("sdxl-full", "sdxl-mini"))
    sd15 = checkpoint_specs("full")
    # SDXL's UNet is 2,567,463,684 parameters (ComfyUI builds the same from its detection, above);
    # OpenCLIP ViT-bigG's text tower 694,659,840 plus its logit_scale.
    assert param_count(_part(full, UNET_PREFIX)) == 2_567_463_684
    assert param_count(_part(full, CLIP_G.prefix)) == 694_659_841
    assert full[CLIP_G.prefix + "text_projection"].shape == (1280, 1280)
    assert full[CLIP_G.prefix + "transformer.resblocks.31.attn.in_proj_weight"].shape == (3 * 1280, 1280)
    # CLIP-L and the VAE have SD1.5's shapes, under SDXL's prefix for CLIP-L.
    assert {key.removeprefix(CLIP_L.prefix): spec.shape for key, spec in _part(full, CLIP_L.prefix).items()} == {
        key.removeprefix(TEXT_ENCODER_PREFIX): spec.shape for key, spec in _part(sd15, TEXT_ENCODER_PREFIX).items()
    }
    assert {key: spec.shape for key, spec in _part(full, VAE_PREFIX).items()} == {
        key: spec.shape for key, spec in _part(sd15, VAE_PREFIX).items()
    }
    for prefix in (CLIP_L.prefix, CLIP_G.prefix, VAE_PREFIX):
        assert _part(mini, prefix) == _part(full, prefix)
    assert param_count(_part(mini, UNET_PREFIX)) == 188_130_884
    assert mini[UNET_PREFIX + "label_emb.0.0.weight"].shape == (1280, 2816)
    assert mini[UNET_PREFIX + "input_blocks.4.1.proj_in.weight"].shape == (320, 320)  # linear, not 1x1 conv


# --- SD3.5 and Flux ----------------------------------------------------------------------------

# The DiT checkpoints ComfyUI can build (flux-tiny's toy width is not one).
DIT_MODELS = ["sd35-tiny", "sd35-mini", "sd35-medium", "sd35-full", "flux-mini", "flux-schnell", "flux-full"]


@pytest.mark.parametrize("name", DIT_MODELS)
def test_dit_checkpoints_are_what_comfyui_detects_and_builds(name):
    """ComfyUI's detection reads the family's config back from the keys and shapes, matches the
    family's class, and builds a diffusion model with exactly the generated tensors."""
    family, _ = resolve_model(name)
    cfg = checkpoint_config(name).diffusion_model
    comfy = COMFYUI_MANIFEST[name]
    assert comfy["supported_model"] in family.comfy_configs
    detected = comfy["detected"]
    if isinstance(cfg, MMDiTConfig):
        assert (detected["depth"], detected["in_channels"], detected["adm_in_channels"]) == (cfg.depth, cfg.in_channels, cfg.adm_in_channels)
        assert detected["x_block_self_attn_layers"] == list(cfg.x_block_self_attn_layers)
        assert detected["pos_embed_max_size"] == cfg.pos_embed_max_size and detected.get("qk_norm") == "rms"
    else:
        assert (detected["depth"], detected["depth_single_blocks"], detected["hidden_size"]) == (
            cfg.depth, cfg.depth_single_blocks, cfg.hidden_size)
        assert (detected["context_in_dim"], detected["vec_in_dim"], detected["guidance_embed"]) == (
            cfg.context_in_dim, cfg.vec_in_dim, cfg.guidance_embed)
    specs = diffusion_model_specs(cfg)
    assert (len(specs), param_count(specs)) == (comfy["unet_tensors"], comfy["unet_parameters"])
    if "unet" in comfy:
        assert {key: list(spec.shape) for key, spec in specs.items()} == comfy["unet"]


def test_full_dits_have_the_published_parameter_counts():
    # SD3.5 Large's MMDiT: 8.1B. Flux.1-dev: 11,901,408,320, of which txt_in takes T5's 4096-wide
    # states; sdopt's takes CLIP-L's 768 (families/flux.py says why), 3,328 x 3,072 fewer.
    assert param_count(diffusion_model_specs(checkpoint_config("sd35-full").diffusion_model)) == 8_146_280_768
    flux = checkpoint_config("flux-full").diffusion_model
    assert param_count(diffusion_model_specs(flux)) + (4096 - flux.context_in_dim) * flux.hidden_size == 11_901_408_320
    schnell = diffusion_model_specs(checkpoint_config("flux-schnell").diffusion_model)
    assert not any(key.startswith("guidance_in.") for key in schnell)


@pytest.mark.parametrize("name", ["sd35-mini", "flux-mini"])
def test_dit_vae_has_16_latent_channels_and_no_quant_convs(name):
    cfg = checkpoint_config(name)
    vae = _part(checkpoint_specs(name), cfg.vae_prefix)
    assert vae[cfg.vae_prefix + "decoder.conv_in.weight"].shape == (512, 16, 3, 3)
    assert vae[cfg.vae_prefix + "encoder.conv_out.weight"].shape == (32, 512, 3, 3)
    assert not any("quant_conv" in key for key in vae)


@pytest.mark.parametrize("name", ["sd35-tiny", "flux-tiny"])
def test_16_channel_vae_loads_strictly_into_diffusers_and_decodes(name):
    """bench vae builds the DiTs' VAE with diffusers: no quant convs, SD3's and Flux's shift."""
    cfg = checkpoint_config(name)
    vae = AutoencoderKL(**diffusers_vae_config(name)).eval()
    ldm = {key: torch.zeros(spec.shape) for key, spec in vae_ldm_specs(cfg.vae).items()}
    vae.load_state_dict(convert_ldm_vae_checkpoint(ldm, vae.config), strict=True)
    assert vae.config.latent_channels == 16 and vae.config.shift_factor == resolve_model(name)[0].latent.shift
    with torch.no_grad():
        assert vae.decode(torch.randn(1, 16, 4, 4)).sample.shape == (1, 3, 8, 8)


def test_sd35_text_encoders_carry_their_projections_under_sd3_s_prefixes():
    full = checkpoint_specs("sd35-full")
    assert full["text_encoders.clip_g.transformer.text_projection.weight"].shape == (1280, 1280)
    assert full["text_encoders.clip_l.transformer.text_projection.weight"].shape == (768, 768)
    assert full["text_encoders.clip_g.transformer.text_model.encoder.layers.31.mlp.fc1.weight"].shape == (5120, 1280)
    assert not any(key.startswith("text_encoders.t5xxl.") for key in full)


def test_flux_checkpoint_has_no_text_encoder_and_its_file_is_clip_l(tmp_path):
    """ComfyUI builds T5-XXL for a Flux checkpoint that carries any text encoder, so the text
    encoder goes into a file of its own, in the format CLIPLoader detects as CLIP-L."""
    flux = FAMILIES["flux"]
    assert all(key.startswith((UNET_PREFIX, "vae.")) for key in checkpoint_specs("flux-mini"))
    text = separate_text_encoder_specs("flux-mini")
    assert text["text_model.encoder.layers.0.mlp.fc1.weight"].shape == (3072, 768)
    assert "text_model.encoder.layers.11.mlp.fc1.weight" in text and "text_model.encoder.layers.12.mlp.fc1.weight" not in text
    assert separate_text_encoder_specs("sd35-mini") == {} and flux.text_encoder_filename("mini") == "sdopt-mini-flux-text.safetensors"

    summary = write_checkpoint("flux-tiny", tmp_path / "checkpoints" / "m.safetensors", dtype="fp32")
    assert summary.text_encoder_path == tmp_path / "text_encoders" / "m-text.safetensors"
    written = load_file(summary.text_encoder_path)
    assert set(written) == set(separate_text_encoder_specs("flux-tiny"))
    assert summary.tensor_count == len(checkpoint_specs("flux-tiny")) + len(written)
    assert summary.file_bytes == summary.path.stat().st_size + summary.text_encoder_path.stat().st_size
    assert text_encoder_path(tmp_path / "m.safetensors") == tmp_path / "text_encoders" / "m-text.safetensors"
    chosen = write_checkpoint("flux-tiny", tmp_path / "a.safetensors", text_encoder_out=tmp_path / "t.safetensors")
    assert chosen.text_encoder_path == tmp_path / "t.safetensors" and chosen.text_encoder_path.is_file()


ALL_DIT_MODELS = [name for name in MODEL_NAMES if not isinstance(checkpoint_config(name).diffusion_model, UNetConfig)]


def _diffusers_diffusion_model(name: str) -> torch.nn.Module:
    class_name, config = diffusers_diffusion_model(name)
    with torch.device("meta"):
        return getattr(diffusers, class_name)(**config)


@pytest.mark.parametrize("name", ALL_DIT_MODELS)
def test_diffusers_transformers_hold_the_checkpoint_s_diffusion_model(name):
    """Built on the meta device from our kwargs, SD3Transformer2DModel and FluxTransformer2DModel
    hold as many numbers as the generated diffusion model, so plan models the same networks.
    diffusers keeps the MMDiT's position grid as a buffer (ComfyUI: a parameter), so the state
    dicts are compared; diffusers also splits q, k and v, so the tensor counts differ."""
    module = _diffusers_diffusion_model(name)
    specs = diffusion_model_specs(checkpoint_config(name).diffusion_model)
    assert sum(t.numel() for t in module.state_dict().values()) == param_count(specs), name


@pytest.mark.parametrize("name, convert", [("sd35-mini", "convert_sd3_transformer_checkpoint_to_diffusers"),
                                           ("flux-mini", "convert_flux_transformer_checkpoint_to_diffusers")])
def test_dit_checkpoint_keys_load_strictly_into_the_diffusers_transformer(name, convert):
    """diffusers' own single-file converter maps every generated tensor onto our module's, with its
    shape (on meta: nothing is allocated; flux-tiny's width is one the converter cannot split)."""
    from diffusers.loaders import single_file_utils

    module = _diffusers_diffusion_model(name)
    with torch.device("meta"):
        checkpoint = {key[len(UNET_PREFIX):]: torch.empty(spec.shape)
                      for key, spec in checkpoint_specs(name).items() if key.startswith(UNET_PREFIX)}
    module.load_state_dict(getattr(single_file_utils, convert)(checkpoint), strict=True, assign=True)


def test_diffusers_transformer_kwargs_follow_the_family_configs():
    _, sd35 = diffusers_diffusion_model("sd35-medium")
    mmdit = checkpoint_config("sd35-medium").diffusion_model
    assert (sd35["num_layers"], sd35["num_attention_heads"], sd35["attention_head_dim"]) == (24, 24, 64)
    assert sd35["dual_attention_layers"] == tuple(range(13)) and sd35["qk_norm"] == "rms_norm"
    assert (sd35["joint_attention_dim"], sd35["pooled_projection_dim"]) == (mmdit.context_dim, mmdit.adm_in_channels)
    _, dev = diffusers_diffusion_model("flux-full")
    _, schnell = diffusers_diffusion_model("flux-schnell")
    assert (dev["in_channels"], dev["attention_head_dim"], dev["axes_dims_rope"]) == (64, 128, (16, 56, 56))
    assert dev["guidance_embeds"] and not schnell["guidance_embeds"]
    _, toy = diffusers_diffusion_model("flux-tiny")
    assert sum(toy["axes_dims_rope"]) == toy["attention_head_dim"] and all(axis % 2 == 0 for axis in toy["axes_dims_rope"])
    assert diffusers_diffusion_model("sdxl-mini") == ("UNet2DConditionModel", diffusers_unet_config("sdxl-mini"))


def test_diffusers_unet_config_refuses_a_level_with_attention_in_some_output_blocks_only():
    assert checkpoint_config("ref-sd15").diffusion_model.output_block_depths == (0, 0, 1, 0)
    with pytest.raises(UserError, match="attention in some blocks and not in others"):
        diffusers_unet_config("ref-sd15")


def test_output_depths_are_one_per_level_or_one_per_output_block():
    per_level = UNetConfig(channel_mult=(1, 2), num_res_blocks=1, transformer_depth=(1, 0))
    assert per_level.output_block_depths == (1, 1, 0, 0)
    with pytest.raises(ValueError, match="one per level \\(2\\) or one per output block \\(4\\)"):
        _ = replace(per_level, transformer_depth_output=(1, 0, 0)).output_block_depths


def test_diffusers_unet_config_refuses_a_transformer_for_the_diffusers_rungs():
    with pytest.raises(UserError, match="flux-mini is a diffusion transformer: the diffusers rungs of bench speed") as error:
        diffusers_unet_config("flux-mini")
    assert "planner" not in str(error.value)


def test_ensure_checkpoint_writes_only_what_is_missing(tmp_path):
    path = ensure_checkpoint("flux-tiny", tmp_path / "checkpoints" / "m.safetensors")
    text = text_encoder_path(path)
    assert path.is_file() and text.is_file()
    stamps = path.stat().st_mtime_ns, text.stat().st_mtime_ns
    ensure_checkpoint("flux-tiny", path)
    assert (path.stat().st_mtime_ns, text.stat().st_mtime_ns) == stamps, "both present: nothing is rewritten"
    text.unlink()
    ensure_checkpoint("flux-tiny", path)
    assert text.is_file(), "a Flux checkpoint without its text encoder file is written again"
    elsewhere = tmp_path / "t.safetensors"
    ensure_checkpoint("flux-tiny", path, text_encoder_out=elsewhere)
    assert elsewhere.is_file()


# --- LoRA ------------------------------------------------------------------------------------


def _kohya_targets(name: str) -> dict[str, tuple[int, ...]]:
    """Every 2-D weight in the UNet's transformer blocks and the text encoders' layers, under kohya's
    key (what ComfyUI's comfy/lora.py maps): ``lora_unet_`` + the LDM key with dots as underscores;
    ``lora_te_`` (``lora_te1_``/``lora_te2_`` with two encoders) + transformers' key, which is what
    ComfyUI converts OpenCLIP's fused CLIP-G layers to. A DiT's block weights but its modulations,
    under ComfyUI's generic ``diffusion_model.`` + its key."""
    cfg = checkpoint_config(name)
    if isinstance(cfg.diffusion_model, UNetConfig):
        targets = {
            "lora_unet_" + key.removesuffix(".weight").replace(".", "_"): spec.shape
            for key, spec in unet_ldm_specs(cfg.diffusion_model).items()
            if ".transformer_blocks." in key and key.endswith(".weight") and len(spec.shape) == 2
        }
    else:
        targets = {
            "diffusion_model." + key.removesuffix(".weight"): spec.shape
            for key, spec in diffusion_model_specs(cfg.diffusion_model).items()
            if key.split(".")[0] in ("joint_blocks", "double_blocks", "single_blocks") and key.endswith(".weight")
            and len(spec.shape) == 2 and "mod" not in key
        }
    for index, text in enumerate(cfg.text_encoders):
        prefix = "lora_te" if len(cfg.text_encoders) == 1 else f"lora_te{index + 1}"
        for key, spec in clip_text_specs(text).items():
            if key.startswith("text_model.encoder.layers.") and key.endswith(".weight") and len(spec.shape) == 2:
                targets[f"{prefix}_{key.removesuffix('.weight').replace('.', '_')}"] = spec.shape
    return targets


@pytest.mark.parametrize("name", ["tiny", "sdxl-tiny", "sdxl-mini", "sd35-tiny", "flux-tiny"])
def test_lora_adapts_every_transformer_linear_under_kohya_s_keys(name):
    rank = 3
    specs = lora_specs(name, rank)
    layers = {key.removesuffix(".alpha") for key in specs if key.endswith(".alpha")}
    assert set(specs) == {f"{layer}.{part}" for layer in layers for part in ("lora_down.weight", "lora_up.weight", "alpha")}
    targets = _kohya_targets(name)
    assert layers == set(targets)
    for layer in layers:
        out_features, in_features = targets[layer]
        assert specs[f"{layer}.lora_down.weight"].shape == (rank, in_features)
        assert specs[f"{layer}.lora_up.weight"].shape == (out_features, rank)
        assert specs[f"{layer}.alpha"].shape == ()
    if name.startswith("sdxl"):
        assert any(layer.startswith("lora_te2_") for layer in layers) and not any(layer.startswith("lora_te_") for layer in layers)


def test_write_lora_is_deterministic_and_changes_weights_by_half_their_scale(tmp_path):
    first = write_lora("sdxl-tiny", tmp_path / "a.safetensors", rank=8, seed=1, dtype="fp32")
    second = write_lora("sdxl-tiny", tmp_path / "b.safetensors", rank=8, seed=1, dtype="fp32")
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.tensor_count == len(lora_specs("sdxl-tiny", 8))
    lora = load_file(first.path)
    with safe_open(str(first.path), "pt") as file:
        assert file.metadata()["sdopt_lora_for"] == "sdxl-tiny" and file.metadata()["ss_network_dim"] == "8"

    layer = "lora_unet_input_blocks_3_1_transformer_blocks_0_attn2_to_k"
    weight = load_file(write_checkpoint("sdxl-tiny", tmp_path / "model.safetensors", dtype="fp32").path)[
        UNET_PREFIX + "input_blocks.3.1.transformer_blocks.0.attn2.to_k.weight"
    ]
    delta = lora[f"{layer}.lora_up.weight"] @ lora[f"{layer}.lora_down.weight"] * (lora[f"{layer}.alpha"] / 8)
    assert delta.shape == weight.shape
    assert (delta.std() / weight.std()).item() == pytest.approx(0.5, rel=0.25)


def test_lora_rank_below_one_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="rank must be at least 1"):
        write_lora("tiny", tmp_path / "lora.safetensors", rank=0)


def test_a_lora_rank_past_the_narrowest_layer_is_refused_before_writing(tmp_path):
    assert lora_specs("tiny", 32), "tiny's layers are 32 wide at the narrowest"
    with pytest.raises(UserError, match="^--rank 33: tiny's narrowest adapted layer is 32 wide.*give at most 32"):
        write_lora("tiny", tmp_path / "lora.safetensors", rank=33)
    assert list(tmp_path.iterdir()) == []
    assert list(tmp_path.iterdir()) == []


def test_cli_make_lora_writes_the_file(tmp_path, capsys):
    out = tmp_path / "loras" / "lora.safetensors"
    assert cli.main(["make-lora", "sdxl-tiny", "--out", str(out), "--rank", "2"]) == 0
    assert f"rank-2 LoRA for sdxl-tiny (SDXL), {len(_kohya_targets('sdxl-tiny'))} layers" in capsys.readouterr().out
    assert set(load_file(out)) == set(lora_specs("sdxl-tiny", 2))


# --- errors and the CLI ----------------------------------------------------------------------


def test_failed_write_leaves_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous")
    real_generate = modelgen.generate_tensor
    calls = []

    def failing_generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("simulated failure")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(modelgen.files, "generate_tensor", failing_generate)  # where the writer looks it up
    with pytest.raises(RuntimeError, match="simulated"):
        write_checkpoint("tiny", out)
    assert out.read_bytes() == b"previous"
    assert [path.name for path in tmp_path.iterdir()] == ["model.safetensors"]


def test_bad_arguments_raise_user_error(tmp_path):
    with pytest.raises(UserError, match="folder"):
        write_checkpoint("tiny", tmp_path)
    with pytest.raises(UserError, match=r"\.safetensors"):
        write_checkpoint("tiny", tmp_path / "model.ckpt")
    with pytest.raises(UserError, match="unknown model 'huge'"):
        write_checkpoint("huge", tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="dtype"):
        write_checkpoint("tiny", tmp_path / "model.safetensors", dtype="int8")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot create"):
        write_checkpoint("tiny", blocker / "model.safetensors")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]


def test_cli_make_model_writes_the_file(tmp_path, capsys):
    out = tmp_path / "cli" / "tiny.safetensors"
    assert cli.main(["make-model", "tiny", "--out", str(out), "--seed", "1"]) == 0
    assert out.is_file()
    assert str(out) in capsys.readouterr().out
    key = UNET_PREFIX + "out.2.bias"
    expected = modelgen.generate_tensor(key, checkpoint_specs("tiny")[key], seed=1, dtype=torch.float16)
    assert torch.equal(load_file(out)[key], expected)


@pytest.mark.parametrize("bad_out", ["existing_dir", "model.ckpt"])
def test_cli_bad_out_exits_2_with_one_line(tmp_path, capsys, bad_out):
    (tmp_path / "existing_dir").mkdir()
    assert cli.main(["make-model", "tiny", "--out", str(tmp_path / bad_out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdopt: error: ")
    assert err.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing_dir"]


def _files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()]


@pytest.mark.parametrize("out, text_encoder_out, message", [
    ("x/flux.ckpt", None, r"must end in \.safetensors"),
    ("x", None, "is a folder"),
    ("x/flux.safetensors", "x/text.bin", r"must end in \.safetensors"),
    ("x/flux.safetensors", "x/flux.safetensors", "--text-encoder-out .* is the checkpoint's own path"),
    ("x/flux.safetensors", "x/sub/../flux.safetensors", "--text-encoder-out .* is the checkpoint's own path"),
])
def test_flux_output_paths_are_checked_before_anything_is_written(tmp_path, out, text_encoder_out, message):
    """A refused --out leaves no orphan text encoder file, and the text encoder is never written where
    the checkpoint then replaces it (the paths are compared resolved)."""
    (tmp_path / "x" / "sub").mkdir(parents=True)
    with pytest.raises(UserError, match=message):
        write_checkpoint("flux-tiny", tmp_path / out, text_encoder_out=text_encoder_out and tmp_path / text_encoder_out)
    assert _files_under(tmp_path) == []


@pytest.mark.parametrize("name", ["tiny", "sdxl-tiny", "sd35-tiny"])
def test_text_encoder_out_is_refused_for_a_model_whose_text_encoders_are_in_the_checkpoint(tmp_path, name):
    with pytest.raises(UserError, match=f"^--text-encoder-out: {name} .*inside the checkpoint"):
        write_checkpoint(name, tmp_path / "m.safetensors", text_encoder_out=tmp_path / "t.safetensors")
    assert _files_under(tmp_path) == []


@pytest.mark.parametrize("argv", [
    ["flux-tiny", "--out", "x/flux.ckpt"],
    ["flux-tiny", "--out", "x/m.safetensors", "--text-encoder-out", "x/m.safetensors"],
    ["tiny", "--out", "x/m.safetensors", "--text-encoder-out", "x/t.safetensors"],
])
def test_cli_make_model_refuses_bad_output_paths_with_one_line_and_writes_nothing(tmp_path, capsys, argv):
    argv = [str(tmp_path / arg) if arg.startswith("x/") else arg for arg in argv]
    assert cli.main(["make-model", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdopt: error: ") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
