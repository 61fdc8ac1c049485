"""Attention backends behind one calling convention, with availability reasons and auto selection.

Every backend is ``fn(q, k, v, mask=None) -> out`` on SDPA-layout tensors: q ``[B, H, Nq, D]``,
k and v ``[B, H, Nk, D]``, out ``[B, H, Nq, D]`` in q's dtype, scale ``1/sqrt(D)``. A mask is
boolean (True = attend) or additive, and broadcasts to ``[B, H, Nq, Nk]`` as in
``torch.nn.functional.scaled_dot_product_attention``.

Backends (the registry, in order): ``sdpa`` (PyTorch picks the kernel), ``sdpa_flash``,
``sdpa_efficient`` and ``sdpa_math`` (one kernel forced through ``sdpa_kernel``), ``sdpa_fused`` (only the
flash and memory-efficient kernels: memory linear in the tokens), ``xformers``,
``sage`` and ``flash_attn`` (imported on first use, only where installed), ``sliced`` (query
slices, optionally head slices), ``sub_quadratic`` (query and key chunks with an online softmax,
so the full Nq x Nk matrix never exists) and ``naive`` (the reference). ``naive``, ``sliced`` and
``sub_quadratic`` compute in fp32 when the inputs are fp16 or bf16.

Each backend declares where it runs (device, dtypes, head dim, masks, the package it needs);
``available()`` answers for actual tensors, with a reason when the answer is no.

One config, one verb: ``build_attention(AttentionConfig(...))`` returns a callable with the
convention above. For a named backend it resolves per input signature (shapes, dtype, device,
mask) and falls back (``on_unavailable="fallback"``) or raises ``UserError`` (``"error"``). For
``"auto"`` it times every available exact backend on the first real inputs of each signature (at most
``auto.TRIAL_QUERY_ROWS`` of their query rows, and none that would hold the whole score
matrix in more than half the free memory), rejects those whose output differs from ``naive`` beyond
the dtype's tolerance, and keeps the fastest.
For ``"low_memory"`` it takes, per signature, PyTorch's fused SDPA kernels (flash or
memory-efficient, whose memory grows linearly with the tokens) where one takes the inputs, and
``sub_quadratic`` within the memory budget elsewhere. All three expose ``decisions`` for reports.

One module per subject, imports running one way (each imports only those above it):

- ``config``: the selection names, dtypes, memory budget and tolerances every module shares;
- ``kernels``: the backend functions (``naive``, ``sliced``, ``sub_quadratic``, the sdpa variants, the
  optional packages' adapters) and their mask and buffer helpers;
- ``backends``: ``Backend``, ``Limits``, ``Availability``, the registry, ``AttentionConfig`` and the
  built-in entries;
- ``resolution``: a named backend or its fallback for given tensors or a device (``expected_backend``);
- ``per_signature``: ``PerSignature``, the base of the callables, and ``AttentionDecision``;
- ``auto``: ``AutoAttention``, timing and the check against ``naive``;
- ``dispatch``: ``NamedAttention``, ``LowMemoryAttention`` and ``build_attention``;
- ``layouts``: ``packed_heads`` and ``channel_attention``, other tensor layouts.

This ``__init__`` exposes the names code outside the package uses.
"""
from .auto import check_against_naive, time_attention
from .backends import (
    AttentionConfig,
    Backend,
    Limits,
    attention_choices,
    attention_memory_is_linear,
    available,
    backend_function,
    backend_names,
    get_backend,
    register_backend,
    runs_low_precision,
    unregister_backend,
)
from .config import AUTO, DEFAULT_MEMORY_BUDGET_BYTES, HALF_DTYPES, LOW_MEMORY, SELECTIONS
from .dispatch import build_attention
from .kernels import naive_attention, sdpa_attention, sub_quadratic_chunks
from .layouts import channel_attention, packed_heads
from .per_signature import summarize_decisions
from .resolution import AUTO_NOTE, LOW_MEMORY_NOTE, NoAttentionBackend, expected_backend

__all__ = [
    "AUTO", "AUTO_NOTE", "DEFAULT_MEMORY_BUDGET_BYTES", "HALF_DTYPES", "LOW_MEMORY", "LOW_MEMORY_NOTE", "SELECTIONS",
    "AttentionConfig", "Backend", "Limits", "NoAttentionBackend", "attention_choices", "attention_memory_is_linear",
    "available", "backend_function", "backend_names", "build_attention", "channel_attention", "check_against_naive",
    "expected_backend", "get_backend", "naive_attention", "packed_heads", "register_backend", "runs_low_precision",
    "sdpa_attention", "sub_quadratic_chunks", "summarize_decisions", "time_attention", "unregister_backend",
]
