"""Deterministic random LoRAs in kohya's format (what ComfyUI's LoraLoader maps) for a generated model."""
from __future__ import annotations

import os
import re

from ...errors import UserError
from ...families import UNetConfig, checkpoint_config
from .architectures import diffusion_model_specs
from .files import CheckpointSummary, write_safetensors
from .specs import TensorSpec, param_count

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
    path, specs = write_safetensors(
        specs, out, metadata, seed=seed, dtype=dtype, desc=f"sdopt {name} LoRA", progress=progress
    )
    return CheckpointSummary(path, name, seed, dtype, len(specs), param_count(specs), path.stat().st_size)
