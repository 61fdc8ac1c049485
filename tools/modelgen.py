"""Deterministic random-weight checkpoints in the original single-file layout of each model family.

No weights can be downloaded, so sdopt writes its own. What a checkpoint holds comes from
``families``: the family's ``CheckpointConfig`` for the model name (``mini``, ``sdxl-mini``, ...)
gives the diffusion model (``model.diffusion_model.*``: the LDM UNet, SD3's MMDiT or Flux), the text encoders (HF CLIP under their prefix,
e.g. ``cond_stage_model.transformer.text_model.*``, or OpenCLIP's format, SDXL's
``conditioner.embedders.1.model.*``) and the LDM AutoencoderKL (``first_stage_model.*``, Flux's
``vae.*``), written into one safetensors file; Flux's text encoder goes into a file of its own. Per family, ``tiny`` is small for unit tests (not loadable by ComfyUI),
``mini`` is a smaller UNet that ComfyUI still detects as the family, with the text encoders and
VAE at full size (ComfyUI fixes their shapes), ``full`` has the real shapes.

Each tensor depends only on (seed, key), so a given seed always gives the same file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..families import (
    MODEL_NAMES,
    UNET_PREFIX,
    CheckpointConfig,
    DiffusionModelConfig,
    FluxConfig,
    MMDiTConfig,
    TextEncoderConfig,
    UNetConfig,
    VAEConfig,
    checkpoint_config,
    resolve_model,
)
from ..optim.precision import DTYPES
from .progress import progress_bar

# The model names the generator knows (bench_* import this name).
SIZES = MODEL_NAMES

CHECKPOINT_DTYPES = ("fp16", "fp32")
_SAFETENSORS_DTYPE_NAMES = {torch.float16: "F16", torch.float32: "F32"}

# Std of everything that is not a conv/linear weight or a norm scale: biases, embeddings, norm shifts.
_SMALL_STD = 0.02
# OpenCLIP's trained temperature, log(100).
_LOGIT_SCALE = math.log(100.0)
# Where a VAE with ``fp16_overflow`` overflows, and by how much its output is scaled: the conv feeds a
# GroupNorm, which divides the scale out again, so fp32 and bf16 decode as if unscaled, while values
# near 2**16 times their unit scale pass fp16's maximum (65504), as in the real SDXL VAE. A power of
# two keeps the fp16 file an exact scaled copy of the unscaled weights' rounding.
FP16_OVERFLOW_CONV = "decoder.mid.block_1.conv1"
FP16_OVERFLOW_SCALE = 2.0**16

@dataclass(frozen=True)
class TensorSpec:
    """Shape and initial distribution, normal(mean, std), of one checkpoint tensor."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _SpecBuilder:
    """Collects TensorSpecs by module, so each layer's keys and inits are written once."""

    def __init__(self) -> None:
        self.specs: dict[str, TensorSpec] = {}

    def _weight(self, name: str, shape: tuple[int, ...]) -> None:
        # std 1/sqrt(fan_in) keeps activations near unit scale layer after layer, so
        # even the full-depth networks stay finite in fp16.
        self.specs[f"{name}.weight"] = TensorSpec(shape, std=math.prod(shape[1:]) ** -0.5)

    def _bias(self, name: str, channels: int) -> None:
        self.specs[f"{name}.bias"] = TensorSpec((channels,), std=_SMALL_STD)

    def conv(self, name: str, out_channels: int, in_channels: int, kernel: int) -> None:
        self._weight(name, (out_channels, in_channels, kernel, kernel))
        self._bias(name, out_channels)

    def linear(self, name: str, out_features: int, in_features: int, bias: bool = True) -> None:
        self._weight(name, (out_features, in_features))
        if bias:
            self._bias(name, out_features)

    def norm(self, name: str, channels: int) -> None:
        # Scales near 1 and shifts near 0, but not exactly: equivalence tests of fused
        # norms should fail if the affine parameters are dropped.
        self.specs[f"{name}.weight"] = TensorSpec((channels,), std=_SMALL_STD, mean=1.0)
        self._bias(name, channels)

    def embedding(self, name: str, count: int, dim: int) -> None:
        self.specs[f"{name}.weight"] = TensorSpec((count, dim), std=_SMALL_STD)

    def scale(self, name: str, factor: float) -> None:
        """Multiply the weight and bias of module ``name`` by ``factor``."""
        for key in (f"{name}.weight", f"{name}.bias"):
            spec = self.specs[key]
            self.specs[key] = TensorSpec(spec.shape, std=spec.std * factor, mean=spec.mean * factor)


def _unet_res_block(b: _SpecBuilder, name: str, in_channels: int, out_channels: int, time_embed_dim: int) -> None:
    b.norm(f"{name}.in_layers.0", in_channels)
    b.conv(f"{name}.in_layers.2", out_channels, in_channels, 3)
    b.linear(f"{name}.emb_layers.1", out_channels, time_embed_dim)
    b.norm(f"{name}.out_layers.0", out_channels)
    b.conv(f"{name}.out_layers.3", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.skip_connection", out_channels, in_channels, 1)


def _unet_spatial_transformer(b: _SpecBuilder, name: str, channels: int, depth: int, cfg: UNetConfig) -> None:
    b.norm(f"{name}.norm", channels)
    # SD1.x projects with 1x1 convs; SD2 and SDXL with linear layers (use_linear_in_transformer).
    project = b.linear if cfg.use_linear_in_transformer else (lambda key, out, inp: b.conv(key, out, inp, 1))
    project(f"{name}.proj_in", channels, channels)
    for index in range(depth):
        block = f"{name}.transformer_blocks.{index}"
        for attn, kv_dim in (("attn1", channels), ("attn2", cfg.context_dim)):
            b.linear(f"{block}.{attn}.to_q", channels, channels, bias=False)
            b.linear(f"{block}.{attn}.to_k", channels, kv_dim, bias=False)
            b.linear(f"{block}.{attn}.to_v", channels, kv_dim, bias=False)
            b.linear(f"{block}.{attn}.to_out.0", channels, channels)
        # GEGLU: one projection yields both the value and the gate, hence 2 x 4 x channels.
        b.linear(f"{block}.ff.net.0.proj", 2 * 4 * channels, channels)
        b.linear(f"{block}.ff.net.2", channels, 4 * channels)
        for norm in ("norm1", "norm2", "norm3"):
            b.norm(f"{block}.{norm}", channels)
    project(f"{name}.proj_out", channels, channels)


def unet_ldm_specs(cfg: UNetConfig) -> dict[str, TensorSpec]:
    """The LDM ``UNetModel`` state dict (keys without ``model.diffusion_model.``)."""
    b = _SpecBuilder()
    temb = cfg.time_embed_dim
    b.linear("time_embed.0", temb, cfg.model_channels)
    b.linear("time_embed.2", temb, temb)
    if cfg.adm_in_channels:
        # The y vector's embedding, added to the time embedding (num_classes="sequential").
        b.linear("label_emb.0.0", temb, cfg.adm_in_channels)
        b.linear("label_emb.0.2", temb, temb)

    b.conv("input_blocks.0.0", cfg.model_channels, cfg.in_channels, 3)
    channels = cfg.model_channels
    skip_channels = [channels]  # what each input block hands to its mirror output block
    block = 1
    last_level = len(cfg.channel_mult) - 1
    for level, mult in enumerate(cfg.channel_mult):
        for _ in range(cfg.num_res_blocks):
            _unet_res_block(b, f"input_blocks.{block}.0", channels, cfg.model_channels * mult, temb)
            channels = cfg.model_channels * mult
            if cfg.transformer_depth[level]:
                _unet_spatial_transformer(b, f"input_blocks.{block}.1", channels, cfg.transformer_depth[level], cfg)
            skip_channels.append(channels)
            block += 1
        if level != last_level:
            b.conv(f"input_blocks.{block}.0.op", channels, channels, 3)
            skip_channels.append(channels)
            block += 1

    _unet_res_block(b, "middle_block.0", channels, channels, temb)
    _unet_spatial_transformer(b, "middle_block.1", channels, cfg.transformer_depth_middle, cfg)
    _unet_res_block(b, "middle_block.2", channels, channels, temb)

    block = 0
    for level in reversed(range(len(cfg.channel_mult))):
        depth = cfg.output_depth[level]
        for index in range(cfg.num_res_blocks + 1):
            out_channels = cfg.model_channels * cfg.channel_mult[level]
            _unet_res_block(b, f"output_blocks.{block}.0", channels + skip_channels.pop(), out_channels, temb)
            channels = out_channels
            layer = 1
            if depth:
                _unet_spatial_transformer(b, f"output_blocks.{block}.1", channels, depth, cfg)
                layer = 2
            if level != 0 and index == cfg.num_res_blocks:
                b.conv(f"output_blocks.{block}.{layer}.conv", channels, channels, 3)
            block += 1

    b.norm("out.0", channels)
    b.conv("out.2", cfg.out_channels, channels, 3)
    return b.specs


def clip_text_specs(cfg: TextEncoderConfig) -> dict[str, TensorSpec]:
    """The HF ``CLIPTextModel`` state dict, with the ``text_model.`` key prefix of SD checkpoints.

    transformers >= 5.6 flattened CLIPTextModel, so its own keys lack that prefix. SD1.5 and SDXL
    checkpoints carry no ``position_ids`` (a non-persistent buffer); ``text_projection`` (of
    CLIPTextModelWithProjection) only where the config has a ``projection_dim`` (SD3's encoders).
    """
    b = _SpecBuilder()
    hidden = cfg.hidden_size
    b.embedding("text_model.embeddings.token_embedding", cfg.vocab_size, hidden)
    b.embedding("text_model.embeddings.position_embedding", cfg.max_position_embeddings, hidden)
    for index in range(cfg.num_hidden_layers):
        layer = f"text_model.encoder.layers.{index}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            b.linear(f"{layer}.self_attn.{proj}", hidden, hidden)
        b.norm(f"{layer}.layer_norm1", hidden)
        b.linear(f"{layer}.mlp.fc1", cfg.intermediate_size, hidden)
        b.linear(f"{layer}.mlp.fc2", hidden, cfg.intermediate_size)
        b.norm(f"{layer}.layer_norm2", hidden)
    b.norm("text_model.final_layer_norm", hidden)
    if cfg.projection_dim:
        b.specs["text_projection.weight"] = TensorSpec((cfg.projection_dim, hidden), std=hidden**-0.5)
    return b.specs


def open_clip_text_specs(cfg: TextEncoderConfig) -> dict[str, TensorSpec]:
    """The text tower of an OpenCLIP ``CLIP`` model in its own key format (SDXL's CLIP-G).

    q, k and v sit in one ``attn.in_proj_weight``; ``positional_embedding`` and ``text_projection``
    are bare parameters, the latter stored (hidden, projection) and applied as ``x @ text_projection``.
    """
    b = _SpecBuilder()
    hidden = cfg.hidden_size
    b.embedding("token_embedding", cfg.vocab_size, hidden)
    b.specs["positional_embedding"] = TensorSpec((cfg.max_position_embeddings, hidden), std=_SMALL_STD)
    for index in range(cfg.num_hidden_layers):
        block = f"transformer.resblocks.{index}"
        b.norm(f"{block}.ln_1", hidden)
        b.specs[f"{block}.attn.in_proj_weight"] = TensorSpec((3 * hidden, hidden), std=hidden**-0.5)
        b.specs[f"{block}.attn.in_proj_bias"] = TensorSpec((3 * hidden,), std=_SMALL_STD)
        b.linear(f"{block}.attn.out_proj", hidden, hidden)
        b.norm(f"{block}.ln_2", hidden)
        b.linear(f"{block}.mlp.c_fc", cfg.intermediate_size, hidden)
        b.linear(f"{block}.mlp.c_proj", hidden, cfg.intermediate_size)
    b.norm("ln_final", hidden)
    b.specs["text_projection"] = TensorSpec((hidden, cfg.projection_dim or hidden), std=hidden**-0.5)
    b.specs["logit_scale"] = TensorSpec((), std=0.0, mean=_LOGIT_SCALE)
    return b.specs


_TEXT_ENCODER_SPECS = {"hf_clip": clip_text_specs, "open_clip": open_clip_text_specs}


def text_encoder_specs(cfg: TextEncoderConfig) -> dict[str, TensorSpec]:
    """The state dict of one text encoder in its checkpoint format (keys without ``cfg.prefix``)."""
    return _TEXT_ENCODER_SPECS[cfg.kind](cfg)


def _vae_res_block(b: _SpecBuilder, name: str, in_channels: int, out_channels: int) -> None:
    b.norm(f"{name}.norm1", in_channels)
    b.conv(f"{name}.conv1", out_channels, in_channels, 3)
    b.norm(f"{name}.norm2", out_channels)
    b.conv(f"{name}.conv2", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.nin_shortcut", out_channels, in_channels, 1)


def _vae_mid(b: _SpecBuilder, name: str, channels: int) -> None:
    _vae_res_block(b, f"{name}.block_1", channels, channels)
    b.norm(f"{name}.attn_1.norm", channels)
    for proj in ("q", "k", "v", "proj_out"):
        b.conv(f"{name}.attn_1.{proj}", channels, channels, 1)
    _vae_res_block(b, f"{name}.block_2", channels, channels)


def vae_ldm_specs(cfg: VAEConfig) -> dict[str, TensorSpec]:
    """The LDM ``AutoencoderKL`` state dict (keys without ``first_stage_model.``)."""
    b = _SpecBuilder()
    widths = [cfg.ch * mult for mult in cfg.ch_mult]
    last_level = len(widths) - 1

    b.conv("encoder.conv_in", cfg.ch, cfg.in_channels, 3)
    channels = cfg.ch
    for level, width in enumerate(widths):
        for index in range(cfg.num_res_blocks):
            _vae_res_block(b, f"encoder.down.{level}.block.{index}", channels, width)
            channels = width
        if level != last_level:
            b.conv(f"encoder.down.{level}.downsample.conv", channels, channels, 3)
    _vae_mid(b, "encoder.mid", channels)
    b.norm("encoder.norm_out", channels)
    # The encoder predicts mean and log-variance (double_z), hence 2 x z_channels.
    b.conv("encoder.conv_out", 2 * cfg.z_channels, channels, 3)
    if cfg.quant_conv:
        b.conv("quant_conv", 2 * cfg.z_channels, 2 * cfg.z_channels, 1)
        b.conv("post_quant_conv", cfg.z_channels, cfg.z_channels, 1)
    channels = widths[-1]
    b.conv("decoder.conv_in", channels, cfg.z_channels, 3)
    _vae_mid(b, "decoder.mid", channels)
    for level in reversed(range(len(widths))):
        for index in range(cfg.num_res_blocks + 1):
            _vae_res_block(b, f"decoder.up.{level}.block.{index}", channels, widths[level])
            channels = widths[level]
        if level != 0:
            b.conv(f"decoder.up.{level}.upsample.conv", channels, channels, 3)
    b.norm("decoder.norm_out", channels)
    b.conv("decoder.conv_out", cfg.out_channels, channels, 3)
    if cfg.fp16_overflow:
        b.scale(FP16_OVERFLOW_CONV, FP16_OVERFLOW_SCALE)
    return b.specs


def mmdit_specs(cfg: MMDiTConfig) -> dict[str, TensorSpec]:
    """ComfyUI's MMDiT state dict (keys without ``model.diffusion_model.``): patch, time, vector and
    context embedders, the joint blocks (a text and an image half each), the final layer."""
    b = _SpecBuilder()
    hidden, head = cfg.hidden_size, 64
    mlp = cfg.mlp_ratio * hidden
    b.specs["pos_embed"] = TensorSpec((1, cfg.pos_embed_max_size**2, hidden), std=_SMALL_STD)
    b._weight("x_embedder.proj", (hidden, cfg.in_channels, cfg.patch_size, cfg.patch_size))
    b._bias("x_embedder.proj", hidden)
    b.linear("t_embedder.mlp.0", hidden, 256)
    b.linear("t_embedder.mlp.2", hidden, hidden)
    b.linear("y_embedder.mlp.0", hidden, cfg.adm_in_channels)
    b.linear("y_embedder.mlp.2", hidden, hidden)
    b.linear("context_embedder", hidden, cfg.context_dim)

    def attention(name: str, pre_only: bool) -> None:
        b.linear(f"{name}.qkv", 3 * hidden, hidden)
        if not pre_only:
            b.linear(f"{name}.proj", hidden, hidden)
        if cfg.qk_norm:
            for norm in ("ln_q", "ln_k"):
                b.specs[f"{name}.{norm}.weight"] = TensorSpec((head,), std=_SMALL_STD, mean=1.0)

    for index in range(cfg.depth):
        block = f"joint_blocks.{index}"
        # The last block's text half only feeds the joint attention: no output projection, no MLP.
        pre_only = index == cfg.depth - 1
        attention(f"{block}.context_block.attn", pre_only)
        if not pre_only:
            b.linear(f"{block}.context_block.mlp.fc1", mlp, hidden)
            b.linear(f"{block}.context_block.mlp.fc2", hidden, mlp)
        b.linear(f"{block}.context_block.adaLN_modulation.1", (2 if pre_only else 6) * hidden, hidden)
        dual = index in cfg.x_block_self_attn_layers
        attention(f"{block}.x_block.attn", False)
        if dual:
            attention(f"{block}.x_block.attn2", False)
        b.linear(f"{block}.x_block.mlp.fc1", mlp, hidden)
        b.linear(f"{block}.x_block.mlp.fc2", hidden, mlp)
        b.linear(f"{block}.x_block.adaLN_modulation.1", (9 if dual else 6) * hidden, hidden)
    b.linear("final_layer.linear", cfg.patch_size**2 * cfg.in_channels, hidden)
    b.linear("final_layer.adaLN_modulation.1", 2 * hidden, hidden)
    return b.specs


def flux_specs(cfg: FluxConfig) -> dict[str, TensorSpec]:
    """ComfyUI's Flux state dict (keys without ``model.diffusion_model.``)."""
    b = _SpecBuilder()
    hidden = cfg.hidden_size
    mlp = cfg.mlp_ratio * hidden
    patch = cfg.patch_size**2 * cfg.in_channels
    b.linear("img_in", hidden, patch)
    embedders = [("time_in", 256), ("vector_in", cfg.vec_in_dim)] + ([("guidance_in", 256)] if cfg.guidance_embed else [])
    for name, width in embedders:
        b.linear(f"{name}.in_layer", hidden, width)
        b.linear(f"{name}.out_layer", hidden, hidden)
    b.linear("txt_in", hidden, cfg.context_in_dim)

    def qk_norm(name: str) -> None:
        for norm in ("query_norm", "key_norm"):
            b.specs[f"{name}.{norm}.scale"] = TensorSpec((cfg.head_dim,), std=_SMALL_STD, mean=1.0)

    for index in range(cfg.depth):
        for stream in ("img", "txt"):
            block = f"double_blocks.{index}.{stream}"
            b.linear(f"{block}_mod.lin", 6 * hidden, hidden)
            b.linear(f"{block}_attn.qkv", 3 * hidden, hidden, bias=cfg.qkv_bias)
            qk_norm(f"{block}_attn.norm")
            b.linear(f"{block}_attn.proj", hidden, hidden)
            b.linear(f"{block}_mlp.0", mlp, hidden)
            b.linear(f"{block}_mlp.2", hidden, mlp)
    for index in range(cfg.depth_single_blocks):
        block = f"single_blocks.{index}"
        # linear1 yields q, k, v and the MLP's input at once; linear2 takes attention and MLP outputs.
        b.linear(f"{block}.linear1", 3 * hidden + mlp, hidden)
        b.linear(f"{block}.linear2", hidden, hidden + mlp)
        qk_norm(f"{block}.norm")
        b.linear(f"{block}.modulation.lin", 3 * hidden, hidden)
    b.linear("final_layer.linear", patch, hidden)
    b.linear("final_layer.adaLN_modulation.1", 2 * hidden, hidden)
    return b.specs


_DIFFUSION_MODEL_SPECS = {UNetConfig: unet_ldm_specs, MMDiTConfig: mmdit_specs, FluxConfig: flux_specs}


def diffusion_model_specs(cfg: DiffusionModelConfig) -> dict[str, TensorSpec]:
    """The state dict of a diffusion model in ComfyUI's format (keys without ``model.diffusion_model.``)."""
    return _DIFFUSION_MODEL_SPECS[type(cfg)](cfg)


def checkpoint_specs(name: str) -> dict[str, TensorSpec]:
    """Every tensor of the single-file checkpoint of model ``name``, with full keys."""
    cfg = checkpoint_config(name)
    parts = [(UNET_PREFIX, diffusion_model_specs(cfg.diffusion_model))]
    parts += [(text.prefix, text_encoder_specs(text)) for text in cfg.text_encoders]
    parts.append((cfg.vae_prefix, vae_ldm_specs(cfg.vae)))
    return {prefix + key: spec for prefix, part in parts for key, spec in part.items()}


def separate_text_encoder_specs(name: str) -> dict[str, TensorSpec]:
    """Every tensor of model ``name``'s text encoder file (empty where its checkpoint carries them)."""
    cfg = checkpoint_config(name)
    return {text.prefix + key: spec for text in cfg.separate_text_encoders for key, spec in text_encoder_specs(text).items()}


def param_count(specs: dict[str, TensorSpec]) -> int:
    return sum(spec.numel for spec in specs.values())


# diffusers' text_time embedding (SDXL) takes the y vector as pooled text followed by this many size
# and crop numbers (original height and width, crop top and left, target height and width), each
# embedded to addition_time_embed_dim.
_TEXT_TIME_IDS = 6


def _transformer_layers_per_block(unet: UNetConfig) -> int | list[int]:
    """diffusers' ``transformer_layers_per_block``: one number where every attention level and the
    middle have the same depth (SD1.5, as diffusers reads LDM configs), else one per level (SDXL),
    and then diffusers gives the middle block the last level's depth."""
    depths = {depth for depth in unet.transformer_depth if depth} | {unet.transformer_depth_middle}
    if len(depths) == 1:
        return depths.pop()
    if unet.transformer_depth_middle != unet.transformer_depth[-1]:
        raise ValueError(
            f"diffusers cannot build a middle depth of {unet.transformer_depth_middle} under a last level of "
            f"{unet.transformer_depth[-1]}"
        )
    return list(unet.transformer_depth)


def diffusers_unet_config(name: str) -> dict:
    """``UNet2DConditionModel(**kwargs)`` matching the UNet of model ``name``; a model without one
    (SD3.5, Flux) is a UserError (``diffusers_diffusion_model`` builds their transformers)."""
    cfg = checkpoint_config(name)
    unet = cfg.diffusion_model
    if not isinstance(unet, UNetConfig):
        unet_models = ", ".join(n for n in MODEL_NAMES if isinstance(checkpoint_config(n).diffusion_model, UNetConfig))
        raise UserError(f"{name} is a diffusion transformer: the diffusers rungs of bench speed run UNet models only "
                        f"({unet_models}); leave the diffusers rung out for {name}")
    levels = range(len(unet.channel_mult))
    widths = [unet.model_channels * mult for mult in unet.channel_mult]
    config = {
        "sample_size": cfg.image_size // cfg.vae.downscale,
        "in_channels": unet.in_channels,
        "out_channels": unet.out_channels,
        "down_block_types": [
            "CrossAttnDownBlock2D" if unet.transformer_depth[level] else "DownBlock2D" for level in levels
        ],
        "up_block_types": [
            "CrossAttnUpBlock2D" if unet.output_depth[level] else "UpBlock2D" for level in reversed(levels)
        ],
        "block_out_channels": widths,
        "layers_per_block": unet.num_res_blocks,
        "cross_attention_dim": unet.context_dim,
        # diffusers' legacy name: "attention_head_dim" holds the number of heads, per level where
        # heads come from a head width.
        "attention_head_dim": [unet.heads(width) for width in widths] if unet.num_head_channels else unet.num_heads,
        "transformer_layers_per_block": _transformer_layers_per_block(unet),
    }
    if unet.use_linear_in_transformer:
        config["use_linear_projection"] = True
    if unet.output_depth != unet.transformer_depth:
        config["reverse_transformer_layers_per_block"] = [
            [unet.output_depth[level]] * (unet.num_res_blocks + 1) for level in reversed(levels)
        ]
    if unet.adm_in_channels:
        pooled = cfg.text_encoders[-1].projection_dim
        config.update(
            addition_embed_type="text_time",
            addition_time_embed_dim=(unet.adm_in_channels - pooled) // _TEXT_TIME_IDS,
            projection_class_embeddings_input_dim=unet.adm_in_channels,
        )
    return config


def _sd3_transformer_config(cfg: CheckpointConfig) -> dict:
    """``SD3Transformer2DModel(**kwargs)`` matching an MMDiT: ``depth`` heads of 64."""
    mmdit = cfg.diffusion_model
    return {
        "sample_size": cfg.image_size // cfg.vae.downscale,
        "patch_size": mmdit.patch_size,
        "in_channels": mmdit.in_channels,
        "out_channels": mmdit.in_channels,
        "num_layers": mmdit.depth,
        "attention_head_dim": mmdit.hidden_size // mmdit.depth,
        "num_attention_heads": mmdit.depth,
        "joint_attention_dim": mmdit.context_dim,
        "caption_projection_dim": mmdit.hidden_size,
        "pooled_projection_dim": mmdit.adm_in_channels,
        "pos_embed_max_size": mmdit.pos_embed_max_size,
        "dual_attention_layers": tuple(mmdit.x_block_self_attn_layers),
        "qk_norm": "rms_norm" if mmdit.qk_norm else None,
    }


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux's rotary split of a head over (text index, row, column): (16, 56, 56) of 128, the
    same proportions, each even, for a toy head width."""
    side = 2 * (7 * head_dim // 32)
    return head_dim - 2 * side, side, side


def _flux_transformer_config(cfg: CheckpointConfig) -> dict:
    """``FluxTransformer2DModel(**kwargs)`` matching a Flux: diffusers takes the latent already
    packed into 2x2 patches (``in_channels`` = 16 x patch²) with a patch size of 1."""
    flux = cfg.diffusion_model
    return {
        "patch_size": 1,
        "in_channels": flux.in_channels * flux.patch_size**2,
        "num_layers": flux.depth,
        "num_single_layers": flux.depth_single_blocks,
        "attention_head_dim": flux.head_dim,
        "num_attention_heads": flux.num_heads,
        "joint_attention_dim": flux.context_in_dim,
        "pooled_projection_dim": flux.vec_in_dim,
        "guidance_embeds": flux.guidance_embed,
        "axes_dims_rope": _rope_axes(flux.head_dim),
    }


_DIFFUSERS_DIFFUSION_MODELS = {
    UNetConfig: ("UNet2DConditionModel", lambda cfg, name: diffusers_unet_config(name)),
    MMDiTConfig: ("SD3Transformer2DModel", lambda cfg, name: _sd3_transformer_config(cfg)),
    FluxConfig: ("FluxTransformer2DModel", lambda cfg, name: _flux_transformer_config(cfg)),
}


def diffusers_diffusion_model(name: str) -> tuple[str, dict]:
    """(the diffusers class, its kwargs) matching the diffusion model of model ``name``:
    ``UNet2DConditionModel``, ``SD3Transformer2DModel`` (an MMDiT) or ``FluxTransformer2DModel``."""
    cfg = checkpoint_config(name)
    class_name, config = _DIFFUSERS_DIFFUSION_MODELS[type(cfg.diffusion_model)]
    return class_name, config(cfg, name)


def diffusers_vae_config(name: str) -> dict:
    """``AutoencoderKL(**kwargs)`` matching the VAE of model ``name``."""
    family, _ = resolve_model(name)
    cfg = checkpoint_config(name)
    vae = cfg.vae
    return {
        "sample_size": cfg.image_size,
        "in_channels": vae.in_channels,
        "out_channels": vae.out_channels,
        "down_block_types": ["DownEncoderBlock2D"] * len(vae.ch_mult),
        "up_block_types": ["UpDecoderBlock2D"] * len(vae.ch_mult),
        "block_out_channels": [vae.ch * mult for mult in vae.ch_mult],
        "layers_per_block": vae.num_res_blocks,
        "latent_channels": vae.z_channels,
        "scaling_factor": family.latent.scale,
        # SD3's and Flux's VAEs (diffusers 0.30+ takes these); the UNet families' keep diffusers' defaults
        **({"shift_factor": family.latent.shift} if family.latent.shift else {}),
        **({} if vae.quant_conv else {"use_quant_conv": False, "use_post_quant_conv": False}),
    }


def transformers_clip_text_config(name: str, index: int = 0) -> dict:
    """``CLIPTextConfig(**kwargs)`` matching text encoder ``index`` of model ``name``, counting the
    checkpoint's and then those of its text encoder file (SDXL: 0 is CLIP-L for ``CLIPTextModel``,
    1 is CLIP-G for ``CLIPTextModelWithProjection``; Flux: 0 is the file's CLIP-L)."""
    cfg = checkpoint_config(name)
    text = (cfg.text_encoders + cfg.separate_text_encoders)[index]
    config = {
        "vocab_size": text.vocab_size,
        "max_position_embeddings": text.max_position_embeddings,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        "hidden_act": text.hidden_act,
        # As in ComfyUI's sd1_clip_config.json and clip_config_bigg.json.
        "layer_norm_eps": 1e-5,
        "eos_token_id": 49407,
    }
    if text.projection_dim:
        config["projection_dim"] = text.projection_dim
    return config


def generate_tensor(key: str, spec: TensorSpec, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor stored under ``key``: a function of (seed, key) only, not of the other keys.

    Values are drawn in fp32 and then cast, so an fp16 checkpoint equals the fp32 one
    cast to fp16.
    """
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    values = torch.randn(spec.shape, generator=generator).mul_(spec.std).add_(spec.mean)
    return values.to(dtype)


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    model: str
    seed: int
    dtype: str
    tensor_count: int
    param_count: int
    file_bytes: int
    text_encoder_path: Path | None = None


def _checked_out_path(out: str | os.PathLike) -> Path:
    path = Path(out).expanduser()
    if path.is_dir():
        example = str(path / "model.safetensors")
        raise UserError(f"output path {str(path)!r} is a folder: give a file path such as {example!r}")
    if path.suffix != ".safetensors":
        example = str(path.with_suffix(".safetensors"))
        raise UserError(f"output path {str(path)!r} must end in .safetensors: e.g. {example!r}")
    return path


def _safetensors_header(specs: dict[str, TensorSpec], dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header; tensors follow back to back in key order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, dict] = {"__metadata__": metadata}
    offset = 0
    for key, spec in specs.items():
        end = offset + spec.numel * itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPE_NAMES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    # The format allows trailing spaces; padding to 8 bytes keeps the tensor data aligned.
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_safetensors(
    specs: dict[str, TensorSpec], out: str | os.PathLike, metadata: dict[str, str], *, seed: int, dtype: str,
    desc: str, progress: bool,
) -> tuple[Path, dict[str, TensorSpec]]:
    """Generate ``specs`` into the safetensors file ``out``; returns its path and the specs in file order.

    Tensors are generated and streamed one at a time, so peak memory is one tensor,
    not the model. The file appears only when complete: it is written under a temporary
    name in the same folder and then renamed over ``out``.
    """
    if dtype not in CHECKPOINT_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}")
    # Sorted like safetensors' own writer, so the bytes on disk depend on nothing but (specs, seed, dtype).
    specs = dict(sorted(specs.items()))
    path = _checked_out_path(out)
    torch_dtype = DTYPES[dtype]

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: never clobber another writer's temp file; mode 0o666 lets the umask decide.
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise UserError(f"cannot create {str(path)!r}: {error.strerror or error}; choose a writable folder") from None

    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(_safetensors_header(specs, torch_dtype, metadata))
            for key, spec in progress_bar(specs.items(), desc=desc, unit="tensor", disable=not progress):
                file.write(generate_tensor(key, spec, seed, torch_dtype).numpy())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = f"{error.strerror or error}; free some space or choose another folder"
            raise UserError(f"cannot write {str(path)!r}: {reason}") from None
        raise
    return path, specs


def text_encoder_path(checkpoint: str | os.PathLike) -> Path:
    """Where the text encoder file of a checkpoint written to ``checkpoint`` goes: the
    ``text_encoders`` folder beside ComfyUI's ``checkpoints`` folder when it is written there, else a
    ``text_encoders`` folder inside its own folder (as ``--models`` folders are searched)."""
    path = Path(checkpoint).expanduser()
    root = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return root / "text_encoders" / f"{path.stem}-text.safetensors"


def _checked_text_encoder_out(name: str, checkpoint: Path, text_encoder_out: str | os.PathLike | None) -> Path:
    """Where model ``name``'s text encoder file goes (``text_encoder_out``, default beside
    ``checkpoint``), refused where it is the checkpoint itself: the later write would replace it."""
    path = _checked_out_path(text_encoder_out or text_encoder_path(checkpoint))
    if path.resolve() == checkpoint.resolve():
        example = str(text_encoder_path(checkpoint))
        raise UserError(f"--text-encoder-out {str(path)!r} is the checkpoint's own path (--out): the checkpoint would "
                        f"replace {name}'s text encoder; give the text encoder a file of its own, e.g. {example!r}")
    return path


def write_checkpoint(
    name: str, out: str | os.PathLike, *, seed: int = 0, dtype: str = "fp16", progress: bool = False,
    text_encoder_out: str | os.PathLike | None = None,
) -> CheckpointSummary:
    """Write the checkpoint of model ``name`` (one of ``MODEL_NAMES``) to ``out`` (a .safetensors
    file) and describe it. Peak memory is one tensor; the file appears only when complete.

    A family whose text encoders live apart (Flux) also gets its text encoder file, written first
    to ``text_encoder_out`` (default ``text_encoder_path(out)``, never ``out`` itself); the summary counts
    both files. Any other model refuses ``text_encoder_out``: its text encoders are in the checkpoint."""
    # sdopt_size holds the model name (SD1.5's are its bare sizes, so their files stay as they were).
    metadata = {"format": "pt", "sdopt_size": name, "sdopt_seed": str(seed), "sdopt_dtype": dtype}
    text_specs = separate_text_encoder_specs(name)
    if not text_specs and text_encoder_out is not None:
        family, _ = resolve_model(name)
        raise UserError(f"--text-encoder-out: {name} ({family.title}) has no text encoder file of its own, its text "
                        "encoders are inside the checkpoint; drop --text-encoder-out")
    # Checked before the text encoder file is written: a refused checkpoint path must not leave it behind.
    path = _checked_out_path(out)
    text_file = None
    if text_specs:
        text_file, text_specs = _write_safetensors(
            text_specs, _checked_text_encoder_out(name, path, text_encoder_out), {**metadata, "sdopt_part": "text_encoders"},
            seed=seed, dtype=dtype, desc=f"sdopt {name} text encoder", progress=progress,
        )
    path, specs = _write_safetensors(
        checkpoint_specs(name), path, metadata, seed=seed, dtype=dtype, desc=f"sdopt {name} checkpoint",
        progress=progress,
    )
    file_bytes = path.stat().st_size + (text_file.stat().st_size if text_file else 0)
    return CheckpointSummary(path, name, seed, dtype, len(specs) + len(text_specs),
                             param_count(specs) + param_count(text_specs), file_bytes, text_file)


def ensure_checkpoint(name: str, out: str | os.PathLike, *, text_encoder_out: str | os.PathLike | None = None,
                      progress: bool = False) -> Path:
    """``out``, written (seed 0, fp16) where it or its family's separate text encoder file
    (``text_encoder_out``, default ``text_encoder_path(out)``) is missing."""
    family, size = resolve_model(name)
    path = Path(out)
    text_encoder = Path(text_encoder_out or text_encoder_path(path)) if family.text_encoder_filename(size) else None
    if not path.exists() or (text_encoder is not None and not text_encoder.exists()):
        write_checkpoint(name, path, seed=0, dtype="fp16", progress=progress, text_encoder_out=text_encoder)
    return path


# The layers a LoRA adapts, as kohya's sd-scripts trains them (the format ComfyUI's LoraLoader maps):
# an LDM UNet's transformer-block linears and each text encoder layer's attention and MLP.
_LORA_UNET_LAYERS = re.compile(r"\.transformer_blocks\.\d+\.(attn[12]\.to_(q|k|v|out\.0)|ff\.net\.(0\.proj|2))\.weight$")
# A DiT's block linears that LoRAs train: MMDiT's attention (qkv, proj) and MLP (fc1, fc2), Flux's
# attention and MLPs of both streams and its single blocks' fused linear1 and linear2.
_LORA_DIT_LAYERS = re.compile(r"^(joint|double|single)_blocks\.\d+\..*(qkv|proj|fc[12]|linear[12]|mlp\.[02])\.weight$")
_LORA_TEXT_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
# The LoRA's change of each weight, relative to the weight's own scale: visible in a sampled image,
# small enough to leave it finite.
_LORA_STRENGTH = 0.5


def _lora_module(specs: dict[str, TensorSpec], name: str, out_features: int, in_features: int, rank: int) -> None:
    """kohya's keys for one adapted linear: ``W += up @ down * alpha / rank`` (alpha = rank: scale 1).

    down ~ N(0, 1/in) and up ~ N(0, s^2/rank) make the change's entries N(0, s^2/in), s times the
    weight's own std, 1/sqrt(in).
    """
    specs[f"{name}.lora_down.weight"] = TensorSpec((rank, in_features), std=in_features**-0.5)
    specs[f"{name}.lora_up.weight"] = TensorSpec((out_features, rank), std=_LORA_STRENGTH * rank**-0.5)
    specs[f"{name}.alpha"] = TensorSpec((), std=0.0, mean=float(rank))


def _lora_diffusion_layers(cfg) -> dict[str, tuple[int, int]]:
    """{kohya or ComfyUI key of an adapted layer: (out, in)} of the diffusion model: an LDM UNet's
    transformer linears under kohya's ``lora_unet_<LDM key, dots as underscores>``; a DiT's block
    linears (attention and MLP) under ComfyUI's generic ``diffusion_model.<key>``."""
    specs = diffusion_model_specs(cfg)
    if isinstance(cfg, UNetConfig):
        return {"lora_unet_" + key.removesuffix(".weight").replace(".", "_"): spec.shape
                for key, spec in specs.items() if _LORA_UNET_LAYERS.search(key)}
    return {"diffusion_model." + key.removesuffix(".weight"): spec.shape
            for key, spec in specs.items() if _LORA_DIT_LAYERS.search(key)}


def lora_specs(name: str, rank: int) -> dict[str, TensorSpec]:
    """A rank-``rank`` LoRA for model ``name``: the diffusion model's layers (``_lora_diffusion_layers``),
    and in kohya's format ``lora_te_`` (one text encoder in the checkpoint) or ``lora_te1_``/``lora_te2_``
    (two, SDXL and SD3.5) + ``text_model_encoder_layers_<n>_<layer>`` in transformers' naming, OpenCLIP's
    CLIP-G included. A text encoder in a file of its own (Flux) is not adapted. A rank past the
    narrowest adapted layer's width is refused: it adds nothing there but file size."""
    if rank < 1:
        raise UserError(f"LoRA rank must be at least 1, got {rank}")
    cfg = checkpoint_config(name)
    layers = dict(_lora_diffusion_layers(cfg.diffusion_model))
    for index, text in enumerate(cfg.text_encoders):
        prefix = "lora_te" if len(cfg.text_encoders) == 1 else f"lora_te{index + 1}"
        shapes = {"mlp.fc1": (text.intermediate_size, text.hidden_size), "mlp.fc2": (text.hidden_size, text.intermediate_size)}
        for layer in range(text.num_hidden_layers):
            for module in _LORA_TEXT_LAYERS:
                key = f"{prefix}_text_model_encoder_layers_{layer}_{module.replace('.', '_')}"
                layers[key] = shapes.get(module, (text.hidden_size, text.hidden_size))
    narrowest = min(min(shape) for shape in layers.values())
    if rank > narrowest:
        raise UserError(f"--rank {rank}: {name}'s narrowest adapted layer is {narrowest} wide, and a rank past it adds "
                        f"nothing but file size; give at most {narrowest}")
    specs: dict[str, TensorSpec] = {}
    for key, (out_features, in_features) in layers.items():
        _lora_module(specs, key, out_features, in_features, rank)
    return specs


def write_lora(
    name: str, out: str | os.PathLike, *, rank: int = 4, seed: int = 0, dtype: str = "fp16", progress: bool = False
) -> CheckpointSummary:
    """Write a deterministic random LoRA for model ``name`` (``lora_specs``) to ``out``, a .safetensors
    file for ComfyUI's ``loras`` folder."""
    specs = lora_specs(name, rank)
    metadata = {"format": "pt", "sdopt_lora_for": name, "sdopt_rank": str(rank), "sdopt_seed": str(seed),
                "sdopt_dtype": dtype, "ss_network_dim": str(rank), "ss_network_alpha": str(rank)}
    path, specs = _write_safetensors(
        specs, out, metadata, seed=seed, dtype=dtype, desc=f"sdopt {name} LoRA", progress=progress
    )
    return CheckpointSummary(path, name, seed, dtype, len(specs), param_count(specs), path.stat().st_size)
