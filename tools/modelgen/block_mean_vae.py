"""A hand-built VAE in the LDM ``AutoencoderKL`` layout whose latent is each 8x8 block's mean colour.

ComfyUI fixes the VAE's shape and no trained VAE can be had, so the reference models get one built by
hand: the encoder averages each block of pixels (its downsampling convs are 2x2 means), the decoder
repeats each latent cell over its block (its upsampling convs copy the nearest pixel), and every
residual branch and attention output is zero, so both are the identity on what passes. On pixel art of
that grid (``tools/reference/scenes``) the round trip is exact to ~1e-4.

The one non-linear stage on the way is ``norm_out`` (a GroupNorm and SiLU before ``conv_out``). Each
colour channel ``v`` travels in a group of its own beside ``-v`` and two constant channels ``+K`` and
``-K``: the group's mean is then exactly 0 and its spread ``K`` up to a relative ``v**2 / K**2``, so the
norm only rescales ``v`` by a known factor; a shift of ``+SILU_SHIFT`` puts both ``v`` and ``-v`` where
SiLU is the identity, and ``conv_out`` takes their half-difference, which cancels the shift.

The latent of a block with mean colour ``rgb`` (in [0, 1]) is, in the diffusion model's space
(``process_in``), ``2 * rgb - 1`` on the first three channels and 0 on the rest.
"""
from __future__ import annotations

import torch

from ...families import LatentFormat, VAEConfig
from .vae import vae_ldm_specs

COLOURS = 3
# The constant channels' value: large against |v| <= 1, so the GroupNorm's spread barely depends on the
# image (relative error 1 / (2 * K**2)), small enough that K**2 stays inside fp16's range.
K = 100.0
# Where SiLU(x) = x to within 1e-7 for |x - SILU_SHIFT| <= 1.
SILU_SHIFT = 20.0
# ComfyUI's GroupNorm in the VAE.
GROUPS = 32


def _group_size(channels: int) -> int:
    size = channels // GROUPS
    if size < 4:
        raise ValueError(f"the block-mean VAE carries each colour in a GroupNorm group of 4 channels; {channels} "
                         f"channels in {GROUPS} groups leave {size}")
    return size


def _carrier_channels(group_size: int) -> list[tuple[int, int, int, int]]:
    """(v, -v, +K, -K) channel indices of each colour: the first four channels of its own group."""
    return [tuple(colour * group_size + offset for offset in range(4)) for colour in range(COLOURS)]


def _identity_1x1(out_channels: int, in_channels: int) -> torch.Tensor:
    weight = torch.zeros(out_channels, in_channels, 1, 1)
    size = min(out_channels, in_channels)
    weight[:size, :size, 0, 0] = torch.eye(size)
    return weight


def _centre_tap(channels: int) -> torch.Tensor:
    """A 3x3 conv that passes each channel through unchanged (after ComfyUI's nearest upsampling)."""
    weight = torch.zeros(channels, channels, 3, 3)
    weight[range(channels), range(channels), 1, 1] = 1.0
    return weight


def _mean_of_2x2(channels: int) -> torch.Tensor:
    """ComfyUI's downsampling conv (pad right and bottom by 1, 3x3, stride 2) as the mean of each 2x2
    block: its taps past the block never reach the padding on an even-sized input."""
    weight = torch.zeros(channels, channels, 3, 3)
    weight[range(channels), range(channels), :2, :2] = 0.25
    return weight


def _norm_out(channels: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupNorm scale and shift that give back ``v + SILU_SHIFT`` and ``-v + SILU_SHIFT``: a group of
    (v, -v, K, -K, zeros) has mean 0 and variance (v**2 + K**2) * 2 / group_size, about K**2 * 2 / group_size."""
    weight, bias = torch.zeros(channels), torch.zeros(channels)
    for plus, minus, _, _ in _carrier_channels(group_size):
        weight[[plus, minus]] = K * (2.0 / group_size) ** 0.5
        bias[[plus, minus]] = SILU_SHIFT
    return weight, bias


def _half_difference(out_channels: int, in_channels: int, group_size: int, gain: float) -> torch.Tensor:
    """``conv_out``: colour c = gain * (channel v - channel -v) / 2, which cancels ``SILU_SHIFT``."""
    weight = torch.zeros(out_channels, in_channels, 3, 3)
    for colour, (plus, minus, _, _) in enumerate(_carrier_channels(group_size)):
        weight[colour, plus, 1, 1] = gain / 2
        weight[colour, minus, 1, 1] = -gain / 2
    return weight


def _carriers_in(out_channels: int, in_channels: int, group_size: int, gain: float, offset: float):
    """A ``conv_in`` that writes each colour c as (v, -v, K, -K) with v = gain * input_c + offset."""
    weight = torch.zeros(out_channels, in_channels, 3, 3)
    bias = torch.zeros(out_channels)
    for colour, (plus, minus, const_plus, const_minus) in enumerate(_carrier_channels(group_size)):
        weight[plus, colour, 1, 1], bias[plus] = gain, offset
        weight[minus, colour, 1, 1], bias[minus] = -gain, -offset
        bias[const_plus], bias[const_minus] = K, -K
    return weight, bias


def block_mean_vae_tensors(cfg: VAEConfig, latent: LatentFormat) -> dict[str, torch.Tensor]:
    """Every tensor of the VAE's state dict (keys without ``first_stage_model.``), fp32: the ones this
    construction sets, and zeros for the rest (the residual branches and attention)."""
    specs = vae_ldm_specs(cfg)
    tensors = {key: torch.zeros(spec.shape) for key, spec in specs.items()}
    widths = [cfg.ch * mult for mult in cfg.ch_mult]
    encoder_group, decoder_group = _group_size(widths[-1]), _group_size(widths[0])
    if latent.channels != cfg.z_channels or cfg.z_channels < COLOURS:
        raise ValueError(f"the block-mean VAE needs a latent of at least {COLOURS} channels matching the VAE's")

    for key in tensors:
        module = key.rsplit(".", 1)[0]
        if key.endswith("nin_shortcut.weight"):
            tensors[key] = _identity_1x1(*specs[key].shape[:2])
        elif key.endswith("downsample.conv.weight"):
            tensors[key] = _mean_of_2x2(specs[key].shape[0])
        elif key.endswith("upsample.conv.weight"):
            tensors[key] = _centre_tap(specs[key].shape[0])
        elif module in ("quant_conv", "post_quant_conv") and key.endswith(".weight"):
            tensors[key] = _identity_1x1(*specs[key].shape[:2])

    # Encoder: pixels in [-1, 1] (ComfyUI's process_input) to the block means, then to the VAE's latent:
    # vae_latent = model_latent / scale + shift, with model_latent = 2 * rgb - 1, the pixel value itself.
    tensors["encoder.conv_in.weight"], tensors["encoder.conv_in.bias"] = _carriers_in(
        widths[0], cfg.in_channels, encoder_group, gain=1.0, offset=0.0)
    tensors["encoder.norm_out.weight"], tensors["encoder.norm_out.bias"] = _norm_out(widths[-1], encoder_group)
    tensors["encoder.conv_out.weight"] = _half_difference(2 * cfg.z_channels, widths[-1], encoder_group, 1 / latent.scale)
    tensors["encoder.conv_out.bias"][: cfg.z_channels] = latent.shift

    # Decoder: back from the VAE's latent to the model's (v), and to pixels in [-1, 1].
    tensors["decoder.conv_in.weight"], tensors["decoder.conv_in.bias"] = _carriers_in(
        widths[-1], cfg.z_channels, decoder_group, gain=latent.scale, offset=-latent.shift * latent.scale)
    tensors["decoder.norm_out.weight"], tensors["decoder.norm_out.bias"] = _norm_out(widths[0], decoder_group)
    tensors["decoder.conv_out.weight"] = _half_difference(cfg.out_channels, widths[0], decoder_group, 1.0)
    return tensors


def block_mean_latent(images: torch.Tensor, latent: LatentFormat, downscale: int = 8) -> torch.Tensor:
    """The latent, in the diffusion model's space, that the block-mean VAE gives images ``[B, H, W, 3]``
    in [0, 1] (ComfyUI's IMAGE): ``2 * block mean - 1`` on the colour channels, 0 on the others."""
    pixels = images.movedim(-1, 1).float() * 2 - 1
    means = torch.nn.functional.avg_pool2d(pixels, downscale)
    extra = means.new_zeros(means.shape[0], latent.channels - COLOURS, *means.shape[2:])
    return torch.cat([means, extra], dim=1)
