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
``attention_auto.TRIAL_QUERY_ROWS`` of their query rows, and none that would hold the whole score
matrix in more than half the free memory), rejects those whose output differs from ``naive`` beyond
the dtype's tolerance, and keeps the fastest.
For ``"low_memory"`` it takes, per signature, PyTorch's fused SDPA kernels (flash or
memory-efficient, whose memory grows linearly with the tokens) where one takes the inputs, and
``sub_quadratic`` within the memory budget elsewhere. All three expose ``decisions`` for reports.
"""
from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UserError

AttentionFn = Callable[..., torch.Tensor]

AUTO = "auto"
LOW_MEMORY = "low_memory"
SELECTIONS = (AUTO, LOW_MEMORY)
ON_UNAVAILABLE = ("fallback", "error")
FALLBACK_ORDER = ("sdpa", "sub_quadratic", "naive")
ANY_DEVICE = "*"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# 32 MiB keeps sliced and sub_quadratic more than 20x below naive's peak at 4096 tokens x 8 heads
# (fp32: about 42 and 35 MiB against 1 GiB, output included); a GPU can afford more for speed.
DEFAULT_MEMORY_BUDGET_BYTES = 32 * 2**20
# Score-sized buffers per slice or chunk: ``sliced`` holds the scores and their softmax,
# ``sub_quadratic`` the scores and, with a boolean mask, its additive form. The budget is divided by this.
_SCORE_COPIES = 2
_MIN_KV_CHUNK = 64


@dataclass(frozen=True)
class Tolerance:
    """``|out - naive| <= atol + rtol * |naive|`` elementwise, as in ``torch.allclose``."""

    atol: float
    rtol: float

    def describe(self) -> str:
        return f"atol {self.atol:g} + rtol {self.rtol:g}"


TOLERANCE_FP32 = Tolerance(atol=1e-4, rtol=1e-4)
TOLERANCE_FP16 = Tolerance(atol=5e-3, rtol=5e-3)
TOLERANCE_BF16 = Tolerance(atol=3e-2, rtol=3e-2)
TOLERANCES = {torch.float32: TOLERANCE_FP32, torch.float16: TOLERANCE_FP16, torch.bfloat16: TOLERANCE_BF16}


@dataclass(frozen=True)
class AttentionConfig:
    """What to run: a backend name or ``"auto"``, and the knobs of the chunked backends.

    ``slice_size``: query tokens per slice for ``sliced``; 0 derives it from the memory budget.
    ``head_slice_size``: heads per slice for ``sliced``; 0 takes all heads at once.
    ``memory_budget_bytes``: the score temporaries of one ``sliced`` slice (when ``slice_size``
    is 0) or one ``sub_quadratic`` chunk stay within this.
    """

    backend: str = "sdpa"
    on_unavailable: str = "fallback"
    slice_size: int = 0
    head_slice_size: int = 0
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES

    def __post_init__(self):
        if self.backend not in SELECTIONS:
            get_backend(self.backend)
        if self.on_unavailable not in ON_UNAVAILABLE:
            raise UserError(f"on_unavailable: must be one of {', '.join(ON_UNAVAILABLE)}, not {self.on_unavailable!r}")
        for name in ("slice_size", "head_slice_size"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}: {getattr(self, name)} must be >= 0 (0 = automatic)")
        if self.memory_budget_bytes <= 0:
            raise UserError(f"memory_budget_bytes: {self.memory_budget_bytes} must be > 0")


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Limits:
    """What a backend accepts on one device type."""

    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    max_head_dim: int | None = None
    mask: bool = True


@dataclass(frozen=True)
class Backend:
    """One registry entry. ``limits`` maps a device type (or ``ANY_DEVICE``) to what runs there;
    ``module``/``pip`` name an optional package; ``options`` name the ``AttentionConfig`` fields
    that are passed to ``fn`` as keyword arguments; ``low_precision``: it quantizes inside, so a
    caller that asks for attention at its inputs' precision must not get it; ``linear_memory``: it
    never holds a query-by-key score matrix (fused kernels, slices and chunks within a budget), None
    where that depends on the kernel PyTorch picks."""

    name: str
    fn: AttentionFn
    limits: Mapping[str, Limits]
    description: str = ""
    module: str | None = None
    pip: str | None = None
    options: tuple[str, ...] = ()
    low_precision: bool = False
    linear_memory: bool | None = True

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """How close to exact attention this backend's output at ``dtype`` must come. A backend that
        quantizes inside is held to bf16's bound where the dtype's is tighter: its 8-bit products
        err about as much as bf16 attention does (SageAttention at fp16: 1.1e-02 from sdpa on an
        H200, against fp16's 5e-03), and that is by design, not a fault."""
        own = TOLERANCES.get(dtype, TOLERANCE_FP32)
        if self.low_precision and own.atol < TOLERANCE_BF16.atol:
            return TOLERANCE_BF16
        return own

    def check(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        has_mask: bool = False,
    ) -> Availability:
        """Whether this backend can run; facts given as None are not checked."""
        if self.module is not None:
            problem = _import_problem(self.module, self.pip)
            if problem:
                return Availability(False, problem)
        if device is None:
            return Availability(True)
        device_type = torch.device(device).type
        limits = self.limits.get(device_type, self.limits.get(ANY_DEVICE))
        if limits is None:
            runs_on = sorted(self.limits)
            if runs_on == ["cuda"]:
                return Availability(False, f"{self.name} needs CUDA")
            return Availability(False, f"{self.name} does not run on {device_type} (runs on: {', '.join(runs_on)})")
        if dtype is not None and dtype not in limits.dtypes:
            allowed = ", ".join(_dtype_name(d) for d in limits.dtypes)
            return Availability(False, f"{self.name} on {device_type} supports {allowed} (got {_dtype_name(dtype)})")
        if head_dim is not None and limits.max_head_dim is not None and head_dim > limits.max_head_dim:
            return Availability(False, f"{self.name} supports head dim <= {limits.max_head_dim} (got {head_dim})")
        if has_mask and not limits.mask:
            return Availability(False, f"{self.name} on {device_type} does not support attention masks")
        return Availability(True)


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    if backend.name in SELECTIONS:
        raise ValueError(f"{backend.name!r} is reserved for a selection among backends")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def attention_choices() -> tuple[str, ...]:
    """Every name a user may ask for: ``"auto"``, ``"low_memory"`` and the registered backends."""
    return (*SELECTIONS, *_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"backend: unknown attention backend {name!r}; choose from {', '.join(attention_choices())}") from None


def runs_low_precision(selection: str) -> bool:
    """Whether ``selection`` names a backend that quantizes inside (``auto`` never picks one)."""
    return selection in _REGISTRY and _REGISTRY[selection].low_precision


def attention_memory_is_linear(selection: str) -> bool | None:
    """Whether attention chosen as ``selection`` (``auto``, ``low_memory`` or the backend that runs)
    keeps its memory linear in the tokens; None where it depends on the call: ``auto``'s per-shape
    pick, plain sdpa's kernel."""
    if selection == AUTO:
        return None
    return True if selection == LOW_MEMORY else get_backend(selection).linear_memory


def backend_function(name: str, config: AttentionConfig | None = None) -> AttentionFn:
    """The backend's ``fn(q, k, v, mask=None)`` with its options taken from ``config``."""
    backend = get_backend(name)
    config = config or AttentionConfig()
    if not backend.options:
        return backend.fn
    return functools.partial(backend.fn, **{option: getattr(config, option) for option in backend.options})


def available(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Availability:
    """Whether backend ``name`` can run on these tensors, and if not, why."""
    if name not in _REGISTRY:
        return Availability(False, f"unknown attention backend {name!r}")
    problem = _shape_problem(q, k, v, mask)
    if problem:
        return Availability(False, problem)
    return _REGISTRY[name].check(q.device, q.dtype, q.shape[-1], mask is not None)


# --- resolution of a named backend -------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """The backend to use for a request, and a note saying why when it is not the one requested."""

    requested: str
    name: str
    note: str = ""

    @property
    def fell_back(self) -> bool:
        return self.name != self.requested


def resolve_backend(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    on_unavailable: str = "fallback",
) -> Resolved:
    """The backend that runs these tensors for a request of ``name``.

    ``"fallback"`` goes to the first of ``FALLBACK_ORDER`` that can run, with a note saying so;
    ``"error"`` raises ``UserError`` with the reason (which names the package or requirement).
    """
    return _resolve(name, lambda candidate: available(candidate, q, k, v, mask), on_unavailable)


class NoAttentionBackend(UserError):
    """Falling back found no backend that takes the inputs: a host with attention of its own runs
    its own for that call (``fallback`` never fails a prompt)."""


def resolve_backend_for_device(name: str, device: torch.device | str, on_unavailable: str = "fallback") -> Resolved:
    """Like ``resolve_backend`` before any tensor exists: checks the package and the device only."""
    return _resolve(name, lambda candidate: get_backend(candidate).check(device), on_unavailable)


AUTO_NOTE = "times every available exact backend on the first call of each input shape and keeps the fastest that matches naive"
LOW_MEMORY_NOTE = ("exact attention in the least memory: PyTorch's fused sdpa kernels (flash, memory-efficient; memory linear "
                   "in the tokens) where one takes the inputs, else sub_quadratic within the memory budget")


def expected_backend(config: AttentionConfig, device: torch.device | str) -> tuple[str, str]:
    """(active, note) for ``config`` before any tensor exists; ``on_unavailable="error"`` raises for a
    backend whose package or device is missing."""
    if config.backend == AUTO:
        return f"{AUTO} (pending)", AUTO_NOTE
    if config.backend == LOW_MEMORY:
        fused = get_backend(SDPA_FUSED).check(device)
        return (f"{SDPA_FUSED} (sub_quadratic for inputs no fused kernel takes)", LOW_MEMORY_NOTE) if fused.ok \
            else ("sub_quadratic", f"{LOW_MEMORY_NOTE}; here: {fused.reason}")
    resolved = resolve_backend_for_device(config.backend, device, config.on_unavailable)
    return resolved.name, resolved.note


def _resolve(name: str, check: Callable[[str], Availability], on_unavailable: str) -> Resolved:
    if on_unavailable not in ON_UNAVAILABLE:
        raise UserError(f"on_unavailable: must be one of {', '.join(ON_UNAVAILABLE)}, not {on_unavailable!r}")
    get_backend(name)
    verdict = check(name)
    if verdict.ok:
        return Resolved(name, name)
    if on_unavailable == "error":
        raise UserError(f"backend: {name} cannot run here: {verdict.reason}; pick another backend, or set on_unavailable to fallback")
    reasons = [f"{name}: {verdict.reason}"]
    for candidate in FALLBACK_ORDER:
        if candidate == name or candidate not in _REGISTRY:
            continue
        fallback = check(candidate)
        if fallback.ok:
            return Resolved(name, candidate, f"fallback from {name} to {candidate}: {verdict.reason}")
        reasons.append(f"{candidate}: {fallback.reason}")
    raise NoAttentionBackend(f"backend: no attention backend can run here ({', '.join(reasons)})")


# --- the backends ------------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) V with the whole score matrix in memory; the reference."""
    compute = _compute_dtype(q.dtype)
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
    compute = _compute_dtype(q.dtype)
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
                scores += _as_bias(_mask_view(mask, head_slice, query_slice), compute)
            probs = torch.softmax(scores, dim=-1, out=_view(prob_scratch, shape))
            out[:, head_slice, query_slice] = torch.matmul(probs, values)
    return out


def sliced_slice_size(rows: int, k_tokens: int, element_size: int, memory_budget_bytes: int) -> int:
    """Query tokens per slice so that one slice's score temporaries fit the budget."""
    return max(1, memory_budget_bytes // (_SCORE_COPIES * rows * k_tokens * element_size))


def sub_quadratic_chunks(
    rows: int, q_tokens: int, k_tokens: int, element_size: int, memory_budget_bytes: int
) -> tuple[int, int]:
    """(query chunk, key chunk) whose score temporaries over ``rows`` (batch x heads) fit the budget.

    The key chunk is a power of two near the square root of the affordable chunk area (at least
    ``_MIN_KV_CHUNK``, at most the key count); the query chunk takes the rest of the budget.
    """
    area = max(1, memory_budget_bytes // (_SCORE_COPIES * rows * element_size))
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
    compute = _compute_dtype(q.dtype)
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
                scores += _as_bias(_mask_view(mask, queries=query_slice, keys=key_slice), compute)
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


def _forced_sdpa(kernel: SDPBackend) -> AttentionFn:
    def attention(q, k, v, mask=None):
        q, k, v = _unit_stride(q, k, v)
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask, q.dtype))

    attention.__doc__ = f"``F.scaled_dot_product_attention`` with only the {kernel.name} kernel enabled."
    return attention


SDPA_FUSED = "sdpa_fused"
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


_ALL_FLOAT = {ANY_DEVICE: Limits()}

for _backend in (
    Backend("sdpa", sdpa_attention, _ALL_FLOAT, "PyTorch scaled_dot_product_attention, kernel picked by PyTorch", linear_memory=None),
    Backend(
        "sdpa_flash",
        _forced_sdpa(SDPBackend.FLASH_ATTENTION),
        {"cpu": Limits(), "cuda": Limits(dtypes=HALF_DTYPES, max_head_dim=256, mask=False)},
        "SDPA forced to its FlashAttention kernel",
    ),
    Backend(
        "sdpa_efficient",
        _forced_sdpa(SDPBackend.EFFICIENT_ATTENTION),
        {"cuda": Limits()},
        "SDPA forced to its memory-efficient kernel",
    ),
    Backend("sdpa_math", _forced_sdpa(SDPBackend.MATH), _ALL_FLOAT, "SDPA forced to its math kernel", linear_memory=False),
    Backend(
        SDPA_FUSED,
        sdpa_fused_attention,
        {"cpu": Limits(), "cuda": Limits()},
        "SDPA limited to its fused kernels (flash, memory-efficient): memory linear in the tokens",
    ),
    Backend(
        "xformers",
        xformers_attention,
        {"cuda": Limits()},
        "xFormers memory_efficient_attention",
        module="xformers.ops",
        pip="xformers",
    ),
    Backend(
        "sage",
        sage_attention,
        {"cuda": Limits(dtypes=HALF_DTYPES, max_head_dim=128, mask=False)},
        "SageAttention (8-bit QK)",
        module="sageattention",
        pip="sageattention",
        low_precision=True,
    ),
    Backend(
        "flash_attn",
        flash_attn_attention,
        {"cuda": Limits(dtypes=HALF_DTYPES, max_head_dim=256, mask=False)},
        "FlashAttention 2 (flash-attn package)",
        module="flash_attn",
        pip="flash-attn",
    ),
    Backend(
        "sliced",
        sliced_attention,
        _ALL_FLOAT,
        "exact attention per query slice (and head slice)",
        options=("slice_size", "head_slice_size", "memory_budget_bytes"),
    ),
    Backend(
        "sub_quadratic",
        sub_quadratic_attention,
        _ALL_FLOAT,
        "query and key chunks with an online softmax",
        options=("memory_budget_bytes",),
    ),
    Backend("naive", naive_attention, _ALL_FLOAT, "softmax(QK^T * scale) V, the reference", linear_memory=False),
):
    register_backend(_backend)
del _backend


# --- the per-signature callables ---------------------------------------------------------------


@dataclass(frozen=True)
class AttentionDecision:
    """What ran for one input signature: the pick, the measured median seconds (auto) and the
    backends that were turned down, with reasons."""

    signature: str
    requested: str
    picked: str
    note: str = ""
    times_s: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


# a decision, and the pick's output on the inputs it was made on where deciding computed it
Decided = tuple[AttentionDecision, torch.Tensor | None]


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """The inputs that a decision depends on, as a readable key."""
    text = f"q {_dims(q)} k {_dims(k)} v {_dims(v)} {_dtype_name(q.dtype)} {q.device}"
    if mask is not None:
        text += f" mask {_dims(mask)} {_dtype_name(mask.dtype)}"
    return text


class _PerSignature:
    """Decides once per input signature which backend runs, then runs it."""

    def __init__(self, config: AttentionConfig, on_decision: Callable[[AttentionDecision], None] | None = None):
        self.config = config
        self._on_decision = on_decision
        self._decisions: dict[str, AttentionDecision] = {}
        self._functions: dict[str, AttentionFn] = {}
        self._picks: set[str] = set()

    @property
    def decisions(self) -> list[AttentionDecision]:
        return list(self._decisions.values())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if len(self._picks) == 1 and torch.compiler.is_compiling():
            # One backend for every shape so far: looking the shape up would guard on it, and a
            # dynamic-shape compile would then recompile per resolution.
            (picked,) = self._picks
            return self._function(picked)(q, k, v, mask)
        # a tuple of shapes, not the readable string: torch.compile traces this lookup on every call
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, None if mask is None else (mask.shape, mask.dtype))
        decision = self._decisions.get(key)
        if decision is None:
            decision, out = self._decide(signature(q, k, v, mask), q, k, v, mask)
            self._decisions[key] = decision
            self._picks.add(decision.picked)
            if self._on_decision is not None:
                self._on_decision(decision)
            if out is not None:
                return out
        return self._function(decision.picked)(q, k, v, mask)

    def _function(self, name: str) -> AttentionFn:
        if name not in self._functions:
            self._functions[name] = backend_function(name, self.config)
        return self._functions[name]

    def _decide(self, key, q, k, v, mask) -> Decided:
        """The decision for this signature, and the pick's output on these inputs where deciding
        already computed it (the call then returns it rather than running attention again)."""
        raise NotImplementedError


class NamedAttention(_PerSignature):
    """The configured backend, resolved per signature with the config's ``on_unavailable``."""

    def _decide(self, key, q, k, v, mask) -> Decided:
        resolved = resolve_backend(self.config.backend, q, k, v, mask, self.config.on_unavailable)
        rejected = {resolved.requested: resolved.note} if resolved.fell_back else {}
        return AttentionDecision(key, resolved.requested, resolved.name, resolved.note, rejected=rejected), None


class LowMemoryAttention(_PerSignature):
    """``sdpa_fused`` where one of PyTorch's fused kernels takes the signature (tried once on its
    first inputs: which kernel runs depends on dtype, head dim, mask, layout and the build),
    ``sub_quadratic`` within ``memory_budget_bytes`` elsewhere."""

    def _decide(self, key, q, k, v, mask) -> Decided:
        fused = available(SDPA_FUSED, q, k, v, mask)
        if fused.ok:
            try:
                with warnings.catch_warnings():  # torch warns once per kernel it turns down before raising
                    warnings.simplefilter("ignore")
                    out = self._function(SDPA_FUSED)(q, k, v, mask)
                return AttentionDecision(key, LOW_MEMORY, SDPA_FUSED), out
            except RuntimeError as error:
                fused = Availability(False, f"no fused sdpa kernel takes these inputs ({str(error).splitlines()[0]})")
        return AttentionDecision(key, LOW_MEMORY, "sub_quadratic", f"sub_quadratic: {fused.reason}", rejected={SDPA_FUSED: fused.reason}), None


def build_attention(
    config: AttentionConfig, on_decision: Callable[[AttentionDecision], None] | None = None
) -> _PerSignature:
    """The attention callable for ``config``; ``on_decision`` hears each new per-signature decision."""
    if config.backend == AUTO:
        from .attention_auto import AutoAttention

        return AutoAttention(config, on_decision)
    if config.backend == LOW_MEMORY:
        return LowMemoryAttention(config, on_decision)
    return NamedAttention(config, on_decision)


def summarize_decisions(decisions: list[AttentionDecision]) -> tuple[str, str]:
    """(active, note) for a report: the distinct picks in order, the distinct notes, and (for
    auto) every backend turned down, each once."""
    picks = dict.fromkeys(d.picked for d in decisions)
    notes = dict.fromkeys(d.note for d in decisions if d.note)
    rejected = dict.fromkeys(f"{name} ({reason})" for d in decisions if d.requested == AUTO for name, reason in d.rejected.items())
    if rejected:
        notes["rejected: " + ", ".join(rejected)] = None
    return ", ".join(picks), "; ".join(notes)


# --- other tensor layouts ----------------------------------------------------------------------


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


# --- helpers -----------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF_DTYPES else dtype


def _dims(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")




def _import_problem(module: str, pip: str | None) -> str:
    """'' when ``module`` imports; otherwise why not, naming the pip package."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] == top:
            return f"{pip or top} is not installed: pip install {pip or top}"
        return f"{module} failed to import: {error}"
    except Exception as error:  # broken binary installs raise OSError, RuntimeError, ...
        return f"{module} failed to import: {type(error).__name__}: {error}"
    return ""


def _shape_problem(q, k, v, mask) -> str:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q, k and v must be 4-D [B, H, N, D]"
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return f"q{list(q.shape)}, k{list(k.shape)} and v{list(v.shape)} do not fit [B, H, Nq, D], [B, H, Nk, D]"
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        return "q, k and v must share dtype and device"
    if mask is not None:
        full = (*q.shape[:3], k.shape[2])
        if mask.ndim > 4 or any(m not in (1, f) for m, f in zip(mask.shape[::-1], full[::-1])):
            return f"mask{list(mask.shape)} does not broadcast to {list(full)}"
    return ""


def _mask_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))


def _mask_view(mask: torch.Tensor, heads: slice = slice(None), queries: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor:
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
