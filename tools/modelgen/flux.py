"""Flux: its state dict in ComfyUI's format and diffusers' ``FluxTransformer2DModel`` config matching it."""
from __future__ import annotations

from ...families import CheckpointConfig, FluxConfig
from .specs import SMALL_STD, SpecBuilder, TensorSpec


def flux_specs(cfg: FluxConfig) -> dict[str, TensorSpec]:
    """ComfyUI's Flux state dict (keys without ``model.diffusion_model.``)."""
    b = SpecBuilder()
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
            b.specs[f"{name}.{norm}.scale"] = TensorSpec((cfg.head_dim,), std=SMALL_STD, mean=1.0)

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


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux's rotary split of a head over (text index, row, column): (16, 56, 56) of 128, the
    same proportions, each even, for a toy head width."""
    side = 2 * (7 * head_dim // 32)
    return head_dim - 2 * side, side, side


def flux_transformer_config(cfg: CheckpointConfig) -> dict:
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
