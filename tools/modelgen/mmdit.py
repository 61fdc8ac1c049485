"""SD3's MMDiT: its state dict in ComfyUI's format and diffusers' ``SD3Transformer2DModel`` config
matching it."""
from __future__ import annotations

from ...families import CheckpointConfig, MMDiTConfig
from .specs import SMALL_STD, SpecBuilder, TensorSpec


def mmdit_specs(cfg: MMDiTConfig) -> dict[str, TensorSpec]:
    """ComfyUI's MMDiT state dict (keys without ``model.diffusion_model.``): patch, time, vector and
    context embedders, the joint blocks (a text and an image half each), the final layer."""
    b = SpecBuilder()
    hidden, head = cfg.hidden_size, 64
    mlp = cfg.mlp_ratio * hidden
    b.specs["pos_embed"] = TensorSpec((1, cfg.pos_embed_max_size**2, hidden), std=SMALL_STD)
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
                b.specs[f"{name}.{norm}.weight"] = TensorSpec((head,), std=SMALL_STD, mean=1.0)

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


def sd3_transformer_config(cfg: CheckpointConfig) -> dict:
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
