"""The attention backends' functions, each ``fn(q, k, v, mask=None) -> out`` on SDPA-layout tensors:
``naive`` (the reference), ``sliced``, ``sub_quadratic``, the ``sdpa`` variants, and the adapters of the
optional packages (``xformers``, ``sage``, ``flash_attn``, imported on first use), with the mask, stride
and scratch-buffer helpers they share. The registry that names them is ``backends``."""
from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import DEFAULT_MEMORY_BUDGET_BYTES, SCORE_COPIES, AttentionFn, compute_dtype

_MIN_KV_CHUNK = 64


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) V with the whole score matrix in memory; the reference."""
    compute = compute_dtype(q.dtype)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores += _as_bias(mask, compute)
    return torch.matmul(scores.softmax(dim=-1), v.to(compute)).to(q.dtype)


def sliced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    slice_size: int = 0,
    head_slice_size: int = 0,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
) -> torch.Tensor:
    """Exact attention one slice of queries (and optionally of heads) at a time."""
    batch, heads, q_tokens, head_dim = q.shape
    k_tokens = k.shape[2]
    compute = compute_dtype(q.dtype)
    heads_per_slice = min(head_slice_size or heads, heads)
    tokens_per_slice = min(
        q_tokens,
        slice_size or sliced_slice_size(batch * heads_per_slice, k_tokens, compute.itemsize, memory_budget_bytes),
    )
    scale = head_dim**-0.5
    slice_elements = batch * heads_per_slice * tokens_per_slice * k_tokens
    score_scratch = _scratch(slice_elements, compute, q, k, v)
    prob_scratch = _scratch(slice_elements, compute, q, k, v)
    out = q.new_empty(batch, heads, q_tokens, v.shape[-1])
    for h in range(0, heads, heads_per_slice):
        head_slice = slice(h, h + heads_per_slice)
        keys_t = k[:, head_slice].to(compute).transpose(-2, -1)
        values = v[:, head_slice].to(compute)
        for i in range(0, q_tokens, tokens_per_slice):
            query_slice = slice(i, i + tokens_per_slice)
            query = q[:, head_slice, query_slice].to(compute) * scale
            shape = (*query.shape[:3], k_tokens)
            scores = torch.matmul(query, keys_t, out=_view(score_scratch, shape))
            if mask is not None:
                scores += _as_bias(mask_view(mask, head_slice, query_slice), compute)
            probs = torch.softmax(scores, dim=-1, out=_view(prob_scratch, shape))
            out[:, head_slice, query_slice] = torch.matmul(probs, values)
    return out


def sliced_slice_size(rows: int, k_tokens: int, element_size: int, memory_budget_bytes: int) -> int:
    """Query tokens per slice so that one slice's score temporaries fit the budget."""
    return max(1, memory_budget_bytes // (SCORE_COPIES * rows * k_tokens * element_size))


def sub_quadratic_chunks(
    rows: int, q_tokens: int, k_tokens: int, element_size: int, memory_budget_bytes: int
) -> tuple[int, int]:
    """(query chunk, key chunk) whose score temporaries over ``rows`` (batch x heads) fit the budget.

    The key chunk is a power of two near the square root of the affordable chunk area (at least
    ``_MIN_KV_CHUNK``, at most the key count); the query chunk takes the rest of the budget.
    """
    area = max(1, memory_budget_bytes // (SCORE_COPIES * rows * element_size))
    kv_chunk = min(k_tokens, max(_MIN_KV_CHUNK, 1 << (math.isqrt(area).bit_length() - 1)))
    q_chunk = min(q_tokens, max(1, area // kv_chunk))
    return q_chunk, kv_chunk


def sub_quadratic_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
) -> torch.Tensor:
    """Exact attention over query and key chunks with an online softmax.

    For each query chunk it keeps a running row maximum, a running sum of exponentials and an
    output accumulator; each key chunk rescales both by ``exp(old_max - new_max)`` before adding
    its own contribution, so only one chunk of scores exists at a time.
    """
    batch, heads, q_tokens, head_dim = q.shape
    k_tokens = k.shape[2]
    compute = compute_dtype(q.dtype)
    q_chunk, kv_chunk = sub_quadratic_chunks(batch * heads, q_tokens, k_tokens, compute.itemsize, memory_budget_bytes)
    scale = head_dim**-0.5
    score_scratch = _scratch(batch * heads * q_chunk * kv_chunk, compute, q, k, v)
    out = q.new_empty(batch, heads, q_tokens, v.shape[-1])
    for i in range(0, q_tokens, q_chunk):
        query_slice = slice(i, i + q_chunk)
        query = q[:, :, query_slice].to(compute) * scale  # scaling the queries saves a pass over the scores
        rows = query.shape[2]
        running_max = query.new_full((batch, heads, rows, 1), -math.inf)
        running_sum = query.new_zeros((batch, heads, rows, 1))
        acc = query.new_zeros((batch, heads, rows, v.shape[-1]))
        for j in range(0, k_tokens, kv_chunk):
            key_slice = slice(j, j + kv_chunk)
            keys_t = k[:, :, key_slice].to(compute).transpose(-2, -1)
            scores = torch.matmul(query, keys_t, out=_view(score_scratch, (batch, heads, rows, keys_t.shape[-1])))
            if mask is not None:
                scores += _as_bias(mask_view(mask, queries=query_slice, keys=key_slice), compute)
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            # Rows that have seen only masked (-inf) scores so far keep a finite shift of 0.
            shift = new_max.masked_fill(new_max == -math.inf, 0.0)
            scores.sub_(shift).exp_()
            rescale = (running_max - shift).exp_()
            running_sum.mul_(rescale).add_(scores.sum(dim=-1, keepdim=True))
            acc.mul_(rescale).add_(torch.matmul(scores, v[:, :, key_slice].to(compute)))
            running_max = new_max
        out[:, :, query_slice] = acc.div_(running_sum)
    return out


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; PyTorch picks the kernel."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask, q.dtype))


def forced_sdpa(kernel: SDPBackend) -> AttentionFn:
    """SDPA with only ``kernel`` enabled: the ``sdpa_flash``, ``sdpa_efficient`` and ``sdpa_math`` backends."""

    def attention(q, k, v, mask=None):
        q, k, v = _unit_stride(q, k, v)
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask, q.dtype))

    attention.__doc__ = f"``F.scaled_dot_product_attention`` with only the {kernel.name} kernel enabled."
    return attention


_FUSED_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def sdpa_fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with only its fused kernels (flash, memory-efficient) enabled:
    never the math kernel, whose scores take memory quadratic in the tokens."""
    q, k, v = _unit_stride(q, k, v)
    with sdpa_kernel(_FUSED_KERNELS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask, q.dtype))


def xformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``xformers.ops.memory_efficient_attention`` (layout ``[B, N, H, D]``)."""
    ops = importlib.import_module("xformers.ops")
    q, k, v = _unit_stride(q, k, v)
    bias = None if mask is None else _xformers_bias(mask, q, k)
    out = ops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias)
    return out.transpose(1, 2)


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``sageattention.sageattn`` (8-bit QK) in its ``HND`` layout, which is SDPA's."""
    if mask is not None:
        raise ValueError("sage does not support attention masks")
    sageattention = importlib.import_module("sageattention")
    q, k, v = _unit_stride(q, k, v)
    return sageattention.sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``flash_attn.flash_attn_func`` (layout ``[B, N, H, D]``)."""
    if mask is not None:
        raise ValueError("flash_attn does not support attention masks")
    flash_attn = importlib.import_module("flash_attn")
    q, k, v = _unit_stride(q, k, v)
    out = flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, causal=False)
    return out.transpose(1, 2)


def _xformers_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """An additive bias for xformers: q's dtype, ``[B, H, Nq, Nk]`` as a view of storage whose
    last dimension is padded to a multiple of 8, the alignment its kernels require."""
    batch, heads, q_tokens, _ = q.shape
    k_tokens = k.shape[2]
    bias = _as_bias(_mask_4d(mask), q.dtype)
    storage = bias.new_empty(bias.shape[0], bias.shape[1], q_tokens, k_tokens + (-k_tokens) % 8)
    aligned = storage[..., :k_tokens]
    aligned.copy_(bias.expand(bias.shape[0], bias.shape[1], q_tokens, k_tokens))
    return aligned.expand(batch, heads, q_tokens, k_tokens)


# --- helpers -----------------------------------------------------------------------------------


def _mask_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))


def mask_view(mask: torch.Tensor, heads: slice = slice(None), queries: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor:
    """The part of a broadcastable mask for a slice of heads, queries and keys (a view)."""
    mask = _mask_4d(mask)
    index = tuple(
        part if size != 1 else slice(None) for part, size in zip((slice(None), heads, queries, keys), mask.shape)
    )
    return mask[index]


def _as_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask in ``dtype``: boolean masks become 0 where True and -inf where False."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.to(dtype)


def _unit_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with a unit stride in the head dim, which fused kernels require (a transposed
    view such as the VAE's ``[B, 1, HW, C]`` has none); copies only where needed."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _scratch(elements: int, dtype: torch.dtype, *inputs: torch.Tensor) -> torch.Tensor | None:
    """One flat buffer that every slice or chunk of a call reuses for its scores, so the loop does
    not allocate (and fragment the heap with) a fresh score buffer each time. None when autograd
    records the inputs, because ``out=`` cannot be differentiated."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return None
    return torch.empty(elements, dtype=dtype, device=inputs[0].device)


def _view(scratch: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A contiguous ``shape`` view of the start of ``scratch`` (None without scratch)."""
    return None if scratch is None else scratch[: math.prod(shape)].view(shape)


def _sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask.to(dtype)
