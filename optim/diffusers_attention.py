"""Diffusers adapter: an attention processor that computes attention with an sdopt backend.

``apply_attention(model, AttentionConfig(...))`` installs one ``SDOptAttnProcessor`` on every
compatible ``Attention`` module of a diffusers model (``UNet2DConditionModel``, ``AutoencoderKL``,
anything with ``set_attn_processor``) and returns an ``AppliedAttention`` that holds the attention
callable (for its ``decisions``) and restores the previous processors. Modules with added
key/value projections keep their processors. Apply it to a copy to leave the original untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .attention import HALF_DTYPES, AttentionConfig, AutoAttention, NamedAttention, build_attention

_PROCESSOR_SUFFIX = ".processor"


class SDOptAttnProcessor:
    """A diffusers attention processor (the ``AttnProcessor2_0`` data flow) whose attention
    itself is ``attention(q, k, v, mask)`` on ``[B, heads, N, head_dim]`` tensors."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, key_tokens, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, key_tokens, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        dtype = query.dtype
        if attn.upcast_attention and dtype in HALF_DTYPES:
            query, key, value = query.float(), key.float(), value.float()
        if attn.scale != head_dim**-0.5:  # the backends scale by 1/sqrt(head_dim)
            query = query * (attn.scale * head_dim**0.5)

        hidden_states = self.attention(query, key, value, attention_mask)
        hidden_states = hidden_states.to(dtype).transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


@dataclass
class AppliedAttention:
    """What ``apply_attention`` did: the shared attention callable and the processors it replaced."""

    model: torch.nn.Module
    attention: NamedAttention | AutoAttention
    previous: dict[str, Any]
    patched: list[str]

    def restore(self) -> None:
        self.model.set_attn_processor(dict(self.previous))


def apply_attention(model: torch.nn.Module, config: AttentionConfig) -> AppliedAttention:
    """Route the attention of every compatible ``Attention`` module of ``model`` through ``config``."""
    attention = build_attention(config)
    processor = SDOptAttnProcessor(attention)
    previous = dict(model.attn_processors)
    processors, patched = {}, []
    for name, current in previous.items():
        module = model.get_submodule(name.removesuffix(_PROCESSOR_SUFFIX))
        if getattr(module, "added_kv_proj_dim", None) is None:
            processors[name] = processor
            patched.append(name)
        else:
            processors[name] = current
    model.set_attn_processor(processors)
    return AppliedAttention(model, attention, previous, patched)
