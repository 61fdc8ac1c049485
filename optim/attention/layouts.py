"""Other tensor layouts around an attention callable: q, k, v packed as ``[B, N, heads * D]`` (LDM and
ComfyUI: ``packed_heads``), and a VAE attention block's ``[B, C, *spatial]`` (``channel_attention``)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .config import HALF_DTYPES, AttentionFn


def packed_heads(attention: AttentionFn) -> Callable:
    """``attention`` for q, k, v packed as ``[B, N, heads * D]`` (LDM and ComfyUI), or already
    ``[B, H, N, D]`` with ``skip_reshape``; a 2-D or 3-D mask gains the missing dims; ``upcast``
    computes half inputs in fp32. The output comes back in the inputs' layout and dtype.

    Any of them may also come split into heads, ``[B, N, heads, D]``: SD3's MMDiT hands v over so."""

    def call(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, upcast=False):
        batch = q.shape[0]
        if not skip_reshape:
            q, k, v = (
                (t if t.ndim == 4 else t.reshape(batch, -1, heads, t.shape[-1] // heads)).transpose(1, 2) for t in (q, k, v)
            )
        if mask is not None and mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask is not None and mask.ndim == 3:
            mask = mask.unsqueeze(1)
        dtype = q.dtype
        if upcast and dtype in HALF_DTYPES:
            q, k, v = q.float(), k.float(), v.float()
        out = attention(q, k, v, mask).to(dtype)
        return out if skip_output_reshape else out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1])

    return call


def channel_attention(attention: AttentionFn) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``attention`` for a VAE attention block's q, k, v ``[B, C, *spatial]``: one head of C channels."""

    def call(q, k, v):
        shape = q.shape
        batch, channels = shape[:2]
        q, k, v = (t.reshape(batch, 1, channels, -1).transpose(-2, -1) for t in (q, k, v))
        return attention(q, k, v).transpose(-2, -1).reshape(shape)

    return call
