"""The LDM AutoencoderKL: its state dict (with the fp16 overflow of SDXL's VAE where the family has it)
and diffusers' ``AutoencoderKL`` config matching it."""
from __future__ import annotations

from ...families import VAEConfig, checkpoint_config, resolve_model
from .specs import SpecBuilder, TensorSpec

# Where a VAE with ``fp16_overflow`` overflows, and by how much its output is scaled: the conv feeds a
# GroupNorm, which divides the scale out again, so fp32 and bf16 decode as if unscaled, while values
# near 2**16 times their unit scale pass fp16's maximum (65504), as in the real SDXL VAE. A power of
# two keeps the fp16 file an exact scaled copy of the unscaled weights' rounding.
FP16_OVERFLOW_CONV = "decoder.mid.block_1.conv1"
FP16_OVERFLOW_SCALE = 2.0**16


def _vae_res_block(b: SpecBuilder, name: str, in_channels: int, out_channels: int) -> None:
    b.norm(f"{name}.norm1", in_channels)
    b.conv(f"{name}.conv1", out_channels, in_channels, 3)
    b.norm(f"{name}.norm2", out_channels)
    b.conv(f"{name}.conv2", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.nin_shortcut", out_channels, in_channels, 1)


def _vae_mid(b: SpecBuilder, name: str, channels: int) -> None:
    _vae_res_block(b, f"{name}.block_1", channels, channels)
    b.norm(f"{name}.attn_1.norm", channels)
    for proj in ("q", "k", "v", "proj_out"):
        b.conv(f"{name}.attn_1.{proj}", channels, channels, 1)
    _vae_res_block(b, f"{name}.block_2", channels, channels)


def vae_ldm_specs(cfg: VAEConfig) -> dict[str, TensorSpec]:
    """The LDM ``AutoencoderKL`` state dict (keys without ``first_stage_model.``)."""
    b = SpecBuilder()
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
