"""The diffusers adapter on a tiny UNet2DConditionModel and AutoencoderKL built from config."""
import copy

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.models.attention_processor import AttnProcessor

from sdopt.optim.attention import AUTO, AttentionConfig, backend_names, get_backend
from sdopt.optim.diffusers_attention import SDOptAttnProcessor, apply_attention

# Largest |patched - stock| accepted on the fp32 model outputs (measured: about 1e-6).
ATOL = 1e-5
CPU_CHOICES = [AUTO] + [name for name in backend_names() if get_backend(name).check("cpu").ok]
TINY_BUDGET = 16 * 1024  # cuts even these small attentions into chunks


def _stock(model):
    model.set_attn_processor(AttnProcessor())
    return model


@pytest.fixture()
def unet(tiny_unet):
    return _stock(tiny_unet)


@pytest.fixture(scope="module")
def unet_inputs():
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(2, 4, 8, 8, generator=generator),
        torch.tensor([10, 500]),
        torch.randn(2, 7, 32, generator=generator),
    )


@torch.no_grad()
def _unet_out(model, inputs):
    sample, timestep, context = inputs
    return model(sample, timestep, context).sample


@pytest.mark.parametrize("backend", CPU_CHOICES)
def test_unet_matches_stock_processors(unet, unet_inputs, backend):
    expected = _unet_out(unet, unet_inputs)
    patched = copy.deepcopy(unet)
    applied = apply_attention(patched, AttentionConfig(backend=backend, memory_budget_bytes=TINY_BUDGET))
    assert len(applied.patched) == len(unet.attn_processors) > 0
    assert all(isinstance(p, SDOptAttnProcessor) for p in patched.attn_processors.values())
    assert (_unet_out(patched, unet_inputs) - expected).abs().max().item() <= ATOL
    assert {d.picked for d in applied.attention.decisions} <= set(backend_names())
    if backend != AUTO:
        assert {d.picked for d in applied.attention.decisions} == {backend}


def test_the_original_is_untouched_and_restore_works(unet, unet_inputs):
    before = _unet_out(unet, unet_inputs)
    patched = copy.deepcopy(unet)
    applied = apply_attention(patched, AttentionConfig(backend="sub_quadratic"))
    _unet_out(patched, unet_inputs)
    assert torch.equal(_unet_out(unet, unet_inputs), before)
    assert all(isinstance(p, AttnProcessor) for p in unet.attn_processors.values())
    applied.restore()
    assert all(isinstance(p, AttnProcessor) for p in patched.attn_processors.values())


def test_unavailable_backend_falls_back_in_the_unet(unet, unet_inputs):
    patched = copy.deepcopy(unet)
    applied = apply_attention(patched, AttentionConfig(backend="sdpa_efficient"))
    assert (_unet_out(patched, unet_inputs) - _unet_out(unet, unet_inputs)).abs().max().item() <= ATOL
    assert {d.picked for d in applied.attention.decisions} == {"sdpa"}
    assert all("fallback from sdpa_efficient to sdpa: sdpa_efficient needs CUDA" == d.note for d in applied.attention.decisions)


def test_attention_mask_and_custom_scale(unet):
    attn = copy.deepcopy(unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2)
    attn.scale = 0.3
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 64, 32, generator=generator)
    context = torch.randn(2, 7, 32, generator=generator)
    mask = torch.zeros(2, 1, 7)
    mask[0, 0, 5:] = -10000.0  # diffusers' additive key-padding mask
    with torch.no_grad():
        expected = AttnProcessor()(attn, hidden, context, mask)
        got = SDOptAttnProcessor(get_backend("sub_quadratic").fn)(attn, hidden, context, mask)
    assert (got - expected).abs().max().item() <= ATOL


def test_vae_attention_matches_stock():
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(32,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=4,
        norm_num_groups=32,
    ).eval()
    _stock(vae)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = vae.decode(latents).sample
        patched = copy.deepcopy(vae)
        applied = apply_attention(patched, AttentionConfig(backend="sliced", slice_size=7))
        got = patched.decode(latents).sample
    assert len(applied.patched) == 2  # encoder and decoder mid-block attention
    assert (got - expected).abs().max().item() <= ATOL
