"""The layout adapters: packed ``[B, N, heads * D]`` inputs (reshape flags, masks, upcast) and a VAE
attention block's ``[B, C, *spatial]`` as one head over the spatial tokens."""
import math

import pytest
import torch

from sdopt.optim.attention.backends import AttentionConfig, backend_function
from sdopt.optim.attention.dispatch import build_attention
from sdopt.optim.attention.kernels import naive_attention
from sdopt.optim.attention.layouts import channel_attention, packed_heads

from .support import ATOL, CONFIGS, CPU_BACKENDS


def _sdpa_reference(q, k, v, heads, mask=None):
    """SDPA on [B, N, H*D] inputs, split into heads by hand."""
    batch = q.shape[0]
    split = [t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1])


def _packed(batch=2, q_tokens=33, k_tokens=77, heads=4, head_dim=16, dtype=torch.float32, v_dim=None):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, q_tokens, heads * head_dim, generator=g)
    k = torch.randn(batch, k_tokens, heads * head_dim, generator=g)
    v = torch.randn(batch, k_tokens, heads * (v_dim or head_dim), generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("name", ["sdpa", "naive", "sub_quadratic"])
def test_packed_heads_matches_sdpa(name):
    q, k, v = _packed()
    run = packed_heads(backend_function(name, CONFIGS["tiny-budget"]))
    out = run(q, k, v, 4)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_with_another_value_dim():
    q, k, v = _packed(v_dim=24)
    out = packed_heads(naive_attention)(q, k, v, 4)
    assert out.shape == (2, 33, 4 * 24)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_takes_any_input_already_split_into_heads():
    """SD3's MMDiT packs q and k but hands v over as [B, N, heads, D] (ComfyUI's own attention
    reshapes every input by q's head width)."""
    q, k, v = _packed()
    split_v = v.view(v.shape[0], -1, 4, 16)
    out = packed_heads(naive_attention)(q, k, split_v, 4)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_skip_reshape_and_skip_output_reshape():
    q, k, v = _packed()
    heads, batch = 4, q.shape[0]
    split = [t.view(batch, -1, heads, 16).transpose(1, 2) for t in (q, k, v)]
    expected = _sdpa_reference(q, k, v, heads)
    expected_split = expected.view(batch, -1, heads, 16).transpose(1, 2)
    run = packed_heads(naive_attention)
    tol = dict(atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(run(*split, heads, skip_reshape=True), expected, **tol)
    out = run(*split, heads, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (batch, heads, 33, 16)
    torch.testing.assert_close(out, expected_split, **tol)
    out = run(q, k, v, heads, skip_output_reshape=True)
    assert out.shape == (batch, heads, 33, 16)
    torch.testing.assert_close(out, expected_split, **tol)


@pytest.mark.parametrize("kind", ["additive-2d", "additive-3d", "bool-2d", "bool-3d"])
def test_packed_heads_masks_gain_the_missing_dims(kind):
    q, k, v = _packed()
    g = torch.Generator().manual_seed(8)
    shape = (33, 77) if kind.endswith("2d") else (2, 33, 77)
    if kind.startswith("bool"):
        mask = torch.rand(shape, generator=g) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(shape, generator=g)
    as_4d = mask.view(1, 1, 33, 77) if mask.ndim == 2 else mask.unsqueeze(1)
    expected = _sdpa_reference(q, k, v, 4, as_4d)
    for name in ("sdpa", "naive", "sliced"):
        out = packed_heads(backend_function(name, CONFIGS["tiny-budget"]))(q, k, v, 4, mask)
        torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
    assert not torch.allclose(expected, _sdpa_reference(q, k, v, 4)), "the mask matters"


def test_packed_heads_upcast_computes_in_fp32_and_returns_the_input_dtype():
    seen = []

    def recording(q, k, v, mask=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return naive_attention(q, k, v, mask)

    run = packed_heads(recording)
    q, k, v = _packed(dtype=torch.bfloat16)
    out = run(q, k, v, 4, upcast=True)
    assert seen[-1] == (torch.float32,) * 3 and out.dtype == torch.bfloat16
    expected = _sdpa_reference(q.float(), k.float(), v.float(), 4).to(torch.bfloat16)
    assert torch.equal(out, packed_heads(naive_attention)(q.float(), k.float(), v.float(), 4).to(torch.bfloat16))
    torch.testing.assert_close(out, expected, atol=ATOL[torch.bfloat16], rtol=0)
    out = run(q, k, v, 4)
    assert seen[-1] == (torch.bfloat16,) * 3 and out.dtype == torch.bfloat16
    q32, k32, v32 = _packed()
    assert run(q32, k32, v32, 4, upcast=True).dtype == torch.float32 and seen[-1] == (torch.float32,) * 3


def _single_head_reference(q, k, v):
    """softmax(QᵀK / sqrt(C)) over the spatial tokens, channels as the head dim, computed by hand."""
    batch, channels = q.shape[:2]
    qt, kt, vt = (t.reshape(batch, channels, -1).transpose(1, 2).double() for t in (q, k, v))  # [B, HW, C]
    weights = torch.softmax(qt @ kt.transpose(1, 2) / math.sqrt(channels), dim=-1)
    return (weights @ vt).transpose(1, 2).reshape(q.shape).float()


@pytest.mark.parametrize("spatial", [(6, 7), (3, 4, 5)], ids=["image", "video"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_channel_attention_is_one_head_over_the_spatial_tokens(name, spatial):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 32, *spatial, generator=g) for _ in range(3))
    out = channel_attention(backend_function(name, CONFIGS["tiny-budget"]))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _single_head_reference(q, k, v), atol=ATOL[torch.float32], rtol=0)


def test_channel_attention_through_the_per_signature_callable():
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 16, 5, 5, generator=g) for _ in range(3))
    attention = build_attention(AttentionConfig(backend="sliced", slice_size=7))
    out = channel_attention(attention)(q, k, v)
    (decision,) = attention.decisions
    assert decision.picked == "sliced" and decision.signature.startswith("q 1x1x25x16 ")
    torch.testing.assert_close(out, _single_head_reference(q, k, v), atol=ATOL[torch.float32], rtol=0)
