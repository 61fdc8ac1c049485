"""The backend functions on CPU: each one against naive, with and without masks, the chunked backends'
slices and chunks, and the optional packages' adapters in each library's layout."""
import math
import sys
import types

import pytest
import torch

from sdopt.optim.attention.backends import available, backend_function, get_backend
from sdopt.optim.attention.config import DEFAULT_MEMORY_BUDGET_BYTES
from sdopt.optim.attention.kernels import (
    naive_attention,
    sliced_attention,
    sub_quadratic_attention,
    sub_quadratic_chunks,
    xformers_attention,
)

from .support import ATOL, CONFIGS, CPU_BACKENDS, max_error, qkv


# (batch, heads, query tokens, key tokens, head dim): odd token counts, CLIP's 77-token context,
# SD head dims 40/64/80/160, batch > 1.
SHAPES = [
    (1, 8, 77, 77, 40),
    (2, 4, 333, 77, 64),
    (2, 2, 333, 333, 80),
    (3, 2, 129, 77, 160),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_matches_naive_fp32(name, config, shape):
    q, k, v = qkv(*shape)
    out = backend_function(name, config)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_error(out, q, k, v) <= ATOL[torch.float32]


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_matches_naive_bf16(name):
    q, k, v = qkv(2, 4, 333, 77, 64, torch.bfloat16)
    out = backend_function(name, CONFIGS["tiny-budget"])(q, k, v)
    assert out.dtype == torch.bfloat16
    assert max_error(out, q, k, v) <= ATOL[torch.bfloat16]


def _masks(batch, heads, q_tokens, k_tokens):
    generator = torch.Generator().manual_seed(1)
    keep = torch.rand(1, 1, 1, k_tokens, generator=generator) > 0.3
    keep[..., 0] = True  # no row is fully masked
    return {
        "additive-batch": torch.randn(batch, 1, q_tokens, k_tokens, generator=generator),
        "additive-per-head": torch.randn(batch, heads, q_tokens, k_tokens, generator=generator),
        "additive-2d": torch.randn(q_tokens, k_tokens, generator=generator),
        "bool-key-padding": keep,
    }


@pytest.mark.parametrize("mask_kind", ["additive-batch", "additive-per-head", "additive-2d", "bool-key-padding"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_with_mask_matches_naive(name, mask_kind):
    shape = (2, 4, 333, 77, 64)
    q, k, v = qkv(*shape)
    mask = _masks(2, 4, 333, 77)[mask_kind]
    assert available(name, q, k, v, mask).ok
    out = backend_function(name, CONFIGS["tiny-budget"])(q, k, v, mask)
    assert max_error(out, q, k, v, mask) <= ATOL[torch.float32]


def test_bool_mask_is_additive_minus_infinity():
    q, k, v = qkv(1, 2, 5, 6, 8)
    keep = torch.tensor([True, False, True, True, False, True])
    bias = torch.zeros(6).masked_fill(~keep, -math.inf)
    torch.testing.assert_close(naive_attention(q, k, v, keep), naive_attention(q, k, v, bias))
    torch.testing.assert_close(naive_attention(q, k, v, keep), naive_attention(q, k[:, :, keep], v[:, :, keep]))


def test_sub_quadratic_handles_key_chunks_that_are_entirely_masked():
    q, k, v = qkv(1, 2, 100, 512, 16)
    keep = torch.zeros(512, dtype=torch.bool)
    keep[400:] = True  # the first key chunks hold nothing to attend to
    budget = 2 * 2 * 4 * 64 * 64  # 64 x 64 chunks over 2 rows
    assert sub_quadratic_chunks(2, 100, 512, 4, budget)[1] == 64
    out = sub_quadratic_attention(q, k, v, keep, memory_budget_bytes=budget)
    assert torch.isfinite(out).all()
    assert max_error(out, q, k, v, keep) <= ATOL[torch.float32]


def test_sub_quadratic_chunks_fit_the_budget_and_chunk_the_keys():
    rows, tokens, size = 8, 4096, 4
    q_chunk, kv_chunk = sub_quadratic_chunks(rows, tokens, tokens, size, DEFAULT_MEMORY_BUDGET_BYTES)
    assert kv_chunk < tokens and q_chunk < tokens, "4096 x 4096 at the default budget needs key and query chunks"
    assert 2 * rows * q_chunk * kv_chunk * size <= DEFAULT_MEMORY_BUDGET_BYTES
    assert sub_quadratic_chunks(rows, 77, 77, size, DEFAULT_MEMORY_BUDGET_BYTES) == (77, 77)


def test_sliced_by_heads_and_explicit_slice_size():
    q, k, v = qkv(2, 8, 333, 77, 40)
    mask = _masks(2, 8, 333, 77)["additive-per-head"]
    out = sliced_attention(q, k, v, mask, slice_size=50, head_slice_size=3)
    assert max_error(out, q, k, v, mask) <= ATOL[torch.float32]


def test_naive_computes_half_inputs_in_fp32():
    q, k, v = qkv(1, 2, 33, 33, 16, torch.bfloat16)
    expected = naive_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)
    assert torch.equal(naive_attention(q, k, v), expected)


@pytest.fixture
def fake_packages(monkeypatch):
    """Stand-ins for xformers, sageattention and flash_attn that compute naive attention in
    each library's documented layout, so the adapters' transposes and mask handling are tested."""
    seen = {}

    def memory_efficient_attention(q, k, v, attn_bias=None):  # [B, N, H, D]
        if attn_bias is not None:
            seen["bias"] = attn_bias
            assert attn_bias.shape == (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            assert attn_bias.stride(-2) % 8 == 0, "xformers needs the bias rows aligned to 8"
        return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias).transpose(1, 2)

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False):
        assert tensor_layout == "HND" and not is_causal
        return naive_attention(q, k, v)

    def flash_attn_func(q, k, v, dropout_p=0.0, causal=False):  # [B, N, H, D]
        assert dropout_p == 0.0 and not causal
        return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    xformers = types.ModuleType("xformers")
    xformers.ops = types.ModuleType("xformers.ops")
    xformers.ops.memory_efficient_attention = memory_efficient_attention
    for name, module in {
        "xformers": xformers,
        "xformers.ops": xformers.ops,
        "sageattention": types.SimpleNamespace(sageattn=sageattn),
        "flash_attn": types.SimpleNamespace(flash_attn_func=flash_attn_func),
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return seen


@pytest.mark.parametrize("name", ["xformers", "sage", "flash_attn"])
def test_optional_adapters_keep_the_layout(fake_packages, name):
    q, k, v = qkv(2, 4, 33, 77, 64)
    assert available(name, q, k, v).reason == f"{name} needs CUDA", "installed now: only the device is missing"
    out = get_backend(name).fn(q, k, v)
    assert max_error(out, q, k, v) <= ATOL[torch.float32]


def test_xformers_adapter_builds_an_aligned_bias(fake_packages):
    q, k, v = qkv(2, 4, 33, 77, 64)
    mask = _masks(2, 4, 33, 77)["bool-key-padding"]
    out = xformers_attention(q, k, v, mask)
    assert fake_packages["bias"].dtype == q.dtype
    assert max_error(out, q, k, v, mask) <= ATOL[torch.float32]
