"""The per-architecture adapters: which one a VAE gets, that its step graph covers every module of
the coder, and that the ComfyUI/LDM layout tiles like its own untiled forward (the diffusers
layout's exactness is in ``test_tiling``)."""
import pytest
import torch
from torch import nn

from sdopt.families import FAMILIES
from sdopt.optim.tiled_vae import (
    ARCHITECTURES,
    DECODE,
    ENCODE,
    LDM_AUTOENCODER_KL,
    TiledVAEConfig,
    UnsupportedVAE,
    adapter_for,
    tiled_decode,
    tiled_encode,
    unsupported_reason,
)
from sdopt.optim.tiled_vae.adapters import DiffusersAutoencoderKL, LDMAutoencoderKL, layout_of
from sdopt.optim.tiled_vae.graph import Conv, Downsample, NormAct, Whole

# fp32 storage between passes: only float rounding differs (measured: up to 4.3e-6 on outputs of magnitude ~1).
EXACT_ATOL = 2e-5
TILE = 64
LDM_LATENT = (20, 27)  # 4x downscale: 80x108 px, a 2x2 grid of 64 px tiles


@pytest.fixture(scope="module")
def ldm_latent():
    return torch.randn(2, 4, *LDM_LATENT, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def ldm_pixels():
    return torch.rand(1, 3, 80, 112, generator=torch.Generator().manual_seed(4)) * 2 - 1


def test_every_family_vae_layout_has_an_adapter():
    for family in FAMILIES.values():
        assert family.vae_layout in ARCHITECTURES, family.name
    assert LDM_AUTOENCODER_KL in ARCHITECTURES


@pytest.mark.parametrize("kind", [DECODE, ENCODE])
def test_each_implementation_gets_its_adapter(vae, ldm_vae, kind):
    assert isinstance(adapter_for(vae, kind), DiffusersAutoencoderKL)
    assert isinstance(adapter_for(ldm_vae, kind), LDMAutoencoderKL)
    for family in FAMILIES.values():
        assert isinstance(adapter_for(ldm_vae, kind, family.vae_layout), LDMAutoencoderKL)


def test_an_architecture_without_adapters_is_refused_by_name(ldm_vae, ldm_latent):
    with pytest.raises(UnsupportedVAE, match=f"^the 'flux2_kl' VAE layout: the tiled VAE has adapters for {LDM_AUTOENCODER_KL}"):
        adapter_for(ldm_vae, DECODE, "flux2_kl")
    with pytest.raises(UnsupportedVAE, match="flux2_kl"):
        tiled_decode(ldm_vae, ldm_latent, TiledVAEConfig(tile=TILE), architecture="flux2_kl")


def test_a_coder_of_no_known_layout_says_what_was_looked_for():
    model = nn.Module()
    model.decoder = nn.Sequential(nn.Conv2d(4, 3, 3, padding=1))
    assert unsupported_reason(model, DECODE) == (
        "Sequential is no decoder the tiled VAE knows (looked for ComfyUI/LDM ldm_autoencoder_kl: mid, up; "
        "diffusers ldm_autoencoder_kl: mid_block, up_blocks)")
    assert unsupported_reason(model, ENCODE) == "Module has no encoder"


def _outside(modules, kind: type, wholes) -> set:
    inside = {id(m) for whole in wholes for m in whole.modules()}
    return {id(m) for m in modules if isinstance(m, kind) and id(m) not in inside}


@pytest.mark.parametrize("implementation", ["ldm", "diffusers"])
@pytest.mark.parametrize("kind", [DECODE, ENCODE])
def test_the_graph_covers_every_norm_and_convolution_of_the_coder(vae, ldm_vae, implementation, kind):
    """Every GroupNorm and convolution outside the whole-tensor (attention) steps is one step of the
    graph, and every attention block is one whole-tensor step: nothing of the coder is skipped."""
    model = ldm_vae if implementation == "ldm" else vae
    layout = layout_of(model, kind, 4 if kind == DECODE else 3)
    coder = model.decoder if kind == DECODE else model.encoder
    ops = [v.op for v in layout.graph.values]
    wholes = [op.module for op in ops if isinstance(op, Whole)]
    quant = model.post_quant_conv if kind == DECODE else model.quant_conv
    assert {id(op.norm) for op in ops if isinstance(op, NormAct)} == _outside(coder.modules(), nn.GroupNorm, wholes)
    assert {id(op.module) for op in ops if isinstance(op, (Conv, Downsample))} == \
        _outside([*coder.modules(), quant], nn.Conv2d, wholes)
    attention_blocks = [m for m in coder.modules() if type(m).__name__ in ("AttnBlock", "Attention")]
    assert len(wholes) == len(attention_blocks) > 0
    assert layout.factor == (4 if implementation == "ldm" else 8)


@pytest.mark.parametrize("keep", [True, False])
def test_the_ldm_layout_decodes_like_its_untiled_forward(ldm_vae, ldm_latent, keep):
    with torch.no_grad():
        reference = ldm_vae.decode(ldm_latent)
    result = tiled_decode(ldm_vae, ldm_latent, TiledVAEConfig(tile=TILE, keep_intermediates=keep, store_dtype=None),
                          architecture=LDM_AUTOENCODER_KL)
    assert result.stats.grid == (2, 2) and result.output.shape == reference.shape == (2, 3, 80, 108)
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL


def test_the_ldm_layout_encodes_like_its_untiled_forward(ldm_vae, ldm_pixels):
    with torch.no_grad():
        reference = ldm_vae.encode(ldm_pixels)
    result = tiled_encode(ldm_vae, ldm_pixels, TiledVAEConfig(tile=TILE, store_dtype=None))
    assert result.stats.grid == (2, 2) and result.output.shape == reference.shape == (1, 4, 20, 28)
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL


def test_a_16_channel_vae_without_quant_convs_tiles(ldm_autoencoder, ldm_pixels):
    """The LDM layout of the 16-channel VAEs (no quant_conv, no post_quant_conv)."""
    model = ldm_autoencoder(z_channels=16, quant=False)
    latent = torch.randn(1, 16, *LDM_LATENT, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        decoded, encoded = model.decode(latent), model.encode(ldm_pixels)
    config = TiledVAEConfig(tile=TILE, store_dtype=None)
    assert (tiled_decode(model, latent, config).output - decoded).abs().max().item() <= EXACT_ATOL
    tiled = tiled_encode(model, ldm_pixels, config).output
    assert tiled.shape == encoded.shape == (1, 16, 20, 28)
    assert (tiled - encoded).abs().max().item() <= EXACT_ATOL


def test_a_sampling_posterior_is_refused_for_encode_only(ldm_autoencoder):
    model = ldm_autoencoder(sample=True)
    assert unsupported_reason(model, ENCODE) == "a DiagonalGaussianRegularizer latent regularizer"
    assert unsupported_reason(model, DECODE) is None
