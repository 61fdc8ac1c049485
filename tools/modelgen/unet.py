"""The LDM UNet (SD1.5, SDXL): its state dict in ComfyUI's format and diffusers' ``UNet2DConditionModel``
config matching it."""
from __future__ import annotations

from ...errors import UserError
from ...families import MODEL_NAMES, UNetConfig, checkpoint_config
from .specs import SpecBuilder, TensorSpec


def _unet_res_block(b: SpecBuilder, name: str, in_channels: int, out_channels: int, time_embed_dim: int) -> None:
    b.norm(f"{name}.in_layers.0", in_channels)
    b.conv(f"{name}.in_layers.2", out_channels, in_channels, 3)
    b.linear(f"{name}.emb_layers.1", out_channels, time_embed_dim)
    b.norm(f"{name}.out_layers.0", out_channels)
    b.conv(f"{name}.out_layers.3", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.skip_connection", out_channels, in_channels, 1)


def _unet_spatial_transformer(b: SpecBuilder, name: str, channels: int, depth: int, cfg: UNetConfig) -> None:
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
    b = SpecBuilder()
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

    if cfg.transformer_depth_middle >= -1:
        _unet_res_block(b, "middle_block.0", channels, channels, temb)
    if cfg.transformer_depth_middle >= 0:
        _unet_spatial_transformer(b, "middle_block.1", channels, cfg.transformer_depth_middle, cfg)
        _unet_res_block(b, "middle_block.2", channels, channels, temb)

    block = 0
    depths = list(cfg.output_block_depths)
    for level in reversed(range(len(cfg.channel_mult))):
        for index in range(cfg.num_res_blocks + 1):
            depth = depths.pop()
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


# diffusers' text_time embedding (SDXL) takes the y vector as pooled text followed by this many size
# and crop numbers (original height and width, crop top and left, target height and width), each
# embedded to addition_time_embed_dim.
_TEXT_TIME_IDS = 6


def _transformer_layers_per_block(unet: UNetConfig) -> int | list[int]:
    """diffusers' ``transformer_layers_per_block``: one number where every attention level and the
    middle have the same depth (SD1.5, as diffusers reads LDM configs), else one per level (SDXL),
    and then diffusers gives the middle block the last level's depth."""
    middle = {unet.transformer_depth_middle} if unet.transformer_depth_middle >= 0 else set()
    depths = {depth for depth in unet.transformer_depth if depth} | middle
    if len(depths) == 1:
        return depths.pop()
    if middle and unet.transformer_depth_middle != unet.transformer_depth[-1]:
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
    per_level = unet.num_res_blocks + 1
    # diffusers' up blocks, deepest first, each its output blocks' depths in the order it runs them.
    up_depths = [list(reversed(unet.output_block_depths[level * per_level:(level + 1) * per_level]))
                 for level in reversed(levels)]
    if any(0 in depths and any(depths) for depths in up_depths):
        raise UserError(f"{name}: diffusers cannot build a UNet level whose output blocks have attention in some "
                        "blocks and not in others")
    config = {
        "sample_size": cfg.image_size // cfg.vae.downscale,
        "in_channels": unet.in_channels,
        "out_channels": unet.out_channels,
        "down_block_types": [
            "CrossAttnDownBlock2D" if unet.transformer_depth[level] else "DownBlock2D" for level in levels
        ],
        "up_block_types": [
            "CrossAttnUpBlock2D" if any(depths) else "UpBlock2D" for depths in up_depths
        ],
        "block_out_channels": widths,
        "layers_per_block": unet.num_res_blocks,
        "cross_attention_dim": unet.context_dim,
        # diffusers' legacy name: "attention_head_dim" holds the number of heads, per level where
        # heads come from a head width.
        "attention_head_dim": [unet.heads(width) for width in widths] if unet.num_head_channels else unet.num_heads,
        "transformer_layers_per_block": _transformer_layers_per_block(unet),
    }
    if unet.transformer_depth_middle == -2:
        config["mid_block_type"] = None
    elif unet.transformer_depth_middle == -1:
        raise UserError(f"{name}: diffusers has no middle block of one ResBlock alone")
    if unet.use_linear_in_transformer:
        config["use_linear_projection"] = True
    if unet.transformer_depth_output is not None and unet.transformer_depth_output != unet.transformer_depth:
        config["reverse_transformer_layers_per_block"] = up_depths
    if unet.adm_in_channels:
        pooled = cfg.text_encoders[-1].projection_dim
        config.update(
            addition_embed_type="text_time",
            addition_time_embed_dim=(unet.adm_in_channels - pooled) // _TEXT_TIME_IDS,
            projection_class_embeddings_input_dim=unet.adm_in_channels,
        )
    return config
