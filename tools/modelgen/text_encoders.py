"""The text encoders: HF CLIP and OpenCLIP state dicts in their checkpoint formats, and transformers'
``CLIPTextConfig`` matching each."""
from __future__ import annotations

import math

from ...families import TextEncoderConfig, checkpoint_config
from .specs import SMALL_STD, SpecBuilder, TensorSpec

# OpenCLIP's trained temperature, log(100).
_LOGIT_SCALE = math.log(100.0)


def clip_text_specs(cfg: TextEncoderConfig) -> dict[str, TensorSpec]:
    """The HF ``CLIPTextModel`` state dict, with the ``text_model.`` key prefix of SD checkpoints.

    transformers >= 5.6 flattened CLIPTextModel, so its own keys lack that prefix. SD1.5 and SDXL
    checkpoints carry no ``position_ids`` (a non-persistent buffer); ``text_projection`` (of
    CLIPTextModelWithProjection) only where the config has a ``projection_dim`` (SD3's encoders).
    """
    b = SpecBuilder()
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
    b = SpecBuilder()
    hidden = cfg.hidden_size
    b.embedding("token_embedding", cfg.vocab_size, hidden)
    b.specs["positional_embedding"] = TensorSpec((cfg.max_position_embeddings, hidden), std=SMALL_STD)
    for index in range(cfg.num_hidden_layers):
        block = f"transformer.resblocks.{index}"
        b.norm(f"{block}.ln_1", hidden)
        b.specs[f"{block}.attn.in_proj_weight"] = TensorSpec((3 * hidden, hidden), std=hidden**-0.5)
        b.specs[f"{block}.attn.in_proj_bias"] = TensorSpec((3 * hidden,), std=SMALL_STD)
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
