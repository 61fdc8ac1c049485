"""tools.modelgen.block_mean_vae: the hand-built VAE, run as diffusers' AutoencoderKL (the LDM layout
converted by diffusers' own converter), encodes pixel art on its grid to the block means and decodes it
back exactly, for a 4-channel and a 16-channel latent with its scale and shift."""
from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from sdopt.families import FAMILIES, VAEConfig
from sdopt.tools.modelgen.block_mean_vae import block_mean_latent, block_mean_vae_tensors

# Narrower than ComfyUI's fixed VAE, with the same 8x downscale and GroupNorm groups of 4 channels.
NARROW = VAEConfig(ch=128, ch_mult=(1, 1, 1, 1), num_res_blocks=1)
NARROW_16 = VAEConfig(ch=128, ch_mult=(1, 1, 1, 1), num_res_blocks=1, z_channels=16, quant_conv=False)


def _diffusers_vae(cfg: VAEConfig, family: str) -> AutoencoderKL:
    latent = FAMILIES[family].latent
    config = {
        "in_channels": 3, "out_channels": 3, "latent_channels": cfg.z_channels, "layers_per_block": cfg.num_res_blocks,
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [cfg.ch * mult for mult in cfg.ch_mult], "scaling_factor": latent.scale,
        **({} if cfg.quant_conv else {"use_quant_conv": False, "use_post_quant_conv": False}),
    }
    state = {f"first_stage_model.{key}": value for key, value in block_mean_vae_tensors(cfg, latent).items()}
    vae = AutoencoderKL(**config).eval()
    vae.load_state_dict(convert_ldm_vae_checkpoint(checkpoint=state, config=config), strict=True)
    return vae


def _pixel_art(batch: int = 2, cells: int = 4) -> torch.Tensor:
    colours = torch.rand(batch, cells, cells, 3, generator=torch.Generator().manual_seed(0))
    return colours.repeat_interleave(8, 1).repeat_interleave(8, 2)


@pytest.mark.parametrize(("cfg", "family"), [(NARROW, "sd15"), (NARROW_16, "sd35"), (NARROW_16, "flux")])
def test_encodes_to_block_means_and_decodes_back_exactly(cfg, family):
    latent_format = FAMILIES[family].latent
    vae = _diffusers_vae(cfg, family)
    images = _pixel_art()
    with torch.no_grad():
        encoded = vae.encode(images.movedim(-1, 1) * 2 - 1).latent_dist.mode()
        decoded = vae.decode(encoded).sample
    model_space = (encoded - latent_format.shift) * latent_format.scale
    expected = block_mean_latent(images, latent_format)
    assert model_space.shape == expected.shape == (2, cfg.z_channels, 4, 4)
    torch.testing.assert_close(model_space, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close((decoded.movedim(1, -1) + 1) / 2, images, atol=1e-4, rtol=0)


def test_a_block_that_is_not_flat_decodes_to_its_mean():
    latent_format = FAMILIES["sd15"].latent
    vae = _diffusers_vae(NARROW, "sd15")
    images = _pixel_art(batch=1)
    images[:, :4, :4] = 1.0  # a quarter of the first block turns white
    with torch.no_grad():
        decoded = (vae.decode(vae.encode(images.movedim(-1, 1) * 2 - 1).latent_dist.mode()).sample.movedim(1, -1) + 1) / 2
    block_mean = images[0, :8, :8].mean(dim=(0, 1))
    torch.testing.assert_close(decoded[0, :8, :8], block_mean.expand(8, 8, 3), atol=1e-4, rtol=0)
    assert block_mean_latent(images, latent_format).shape == (1, 4, 4, 4)


def test_a_vae_too_narrow_for_its_groups_is_refused():
    with pytest.raises(ValueError, match="groups"):
        block_mean_vae_tensors(VAEConfig(ch=64, ch_mult=(1, 1, 1, 1), num_res_blocks=1), FAMILIES["sd15"].latent)
