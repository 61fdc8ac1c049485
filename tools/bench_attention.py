"""Micro-benchmarks: each attention backend's time, peak memory and error against ``naive``.

``bench_attention`` runs self-attention (batch 1, Nq = Nk = tokens) on seeded random inputs for
every requested backend and token count; ``attention_table`` renders the rows as markdown.
Peak memory is the growth during one call: on CUDA ``max_memory_allocated`` after a peak reset
minus what was allocated at the reset; elsewhere the process peak RSS (``PeakMemory``, reset
through ``/proc/self/clear_refs``) minus the RSS at the reset. Inputs exist before the reset, so
only the call's own temporaries and output count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import UserError
from ..measure.profiler import MEMORY_LABELS, MEMORY_RAM, PeakMemory, format_mib
from ..measure.report import markdown_table
from ..optim.attention import (
    AttentionConfig,
    available,
    backend_function,
    backend_names,
    check_against_naive,
    get_backend,
    time_attention,
)
from ..optim.heap_trim import trim_heap
from ..optim.precision import COMPUTE_DTYPES, DTYPES
from ..nodes.checks import usable_device
from .progress import progress_bar

SEED = 0

STATUS_OK = "ok"
STATUS_UNAVAILABLE = "unavailable"
STATUS_FAILED = "failed"


@dataclass(frozen=True)
class AttentionBenchRow:
    """One backend at one token count. Numbers are None unless ``status`` is ``"ok"``."""

    backend: str
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    device: str
    status: str
    reason: str = ""
    mean_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_kind: str = ""
    max_abs_error: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def bench_attention(
    tokens: list[int],
    heads: int = 8,
    head_dim: int = 64,
    dtype: str = "fp32",
    device: str = "cpu",
    backends: list[str] | None = None,
    repeats: int = 3,
    config: AttentionConfig | None = None,
    progress: bool = True,
) -> list[AttentionBenchRow]:
    """Rows for every backend (default: every registered one) at every token count.

    ``config`` carries the chunked backends' knobs (slice size, memory budget); unavailable
    backends get a row with the reason.
    """
    torch_dtype = _parse_dtype(dtype)
    torch_device = usable_device(device, instead="give --device cpu")
    names = list(backends) if backends else list(backend_names())
    for name in names:
        get_backend(name)
    if repeats < 1 or heads < 1 or head_dim < 1 or any(n < 1 for n in tokens):
        raise UserError("tokens, heads, head dim and repeats must be >= 1")
    config = config or AttentionConfig()
    rows = []
    with progress_bar(total=len(tokens) * len(names), desc="attention", unit="run", disable=not progress) as bar:
        for count in tokens:
            q, k, v = _inputs(count, heads, head_dim, torch_dtype, torch_device)
            for name in names:
                bar.set_postfix_str(f"{name} @ {count} tokens")
                rows.append(_bench_one(name, q, k, v, dtype, config, repeats))
                bar.update()
            del q, k, v
    return rows


def _bench_one(name, q, k, v, dtype_label, config, repeats) -> AttentionBenchRow:
    base = dict(
        backend=name, tokens=q.shape[2], heads=q.shape[1], head_dim=q.shape[3], dtype=dtype_label, device=str(q.device)
    )
    verdict = available(name, q, k, v)
    if not verdict.ok:
        return AttentionBenchRow(**base, status=STATUS_UNAVAILABLE, reason=verdict.reason)
    fn = backend_function(name, config)
    try:
        check = check_against_naive(fn(q, k, v), q, k, v, tolerance=get_backend(name).tolerance(q.dtype))  # also the warm-up call
        peak, kind, note = peak_memory_delta(fn, q, k, v)
        times = time_attention(fn, q, k, v, None, repeats)
    except Exception as error:  # e.g. out of memory at a large token count: report it, go on
        return AttentionBenchRow(**base, status=STATUS_FAILED, reason=f"{type(error).__name__}: {error}".splitlines()[0])
    return AttentionBenchRow(
        **base,
        status=STATUS_OK,
        reason=note or check.reason,
        mean_s=sum(times) / len(times),
        peak_memory_bytes=peak,
        memory_kind=kind,
        max_abs_error=check.max_abs_error,
    )


def peak_memory_delta(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, str, str]:
    """(bytes the call added at its peak, memory kind, note) for one call of ``fn``.

    On CPU, free heap memory is first handed back to the OS (glibc ``malloc_trim``) so the call
    has to touch fresh pages instead of reusing pages already counted in the RSS.
    """
    memory = PeakMemory(q.device)
    if memory.kind == MEMORY_RAM:
        trim_heap()
    memory.reset()
    before = memory.read().peak_bytes
    out = fn(q, k, v, mask)
    reading = memory.read()
    del out
    return max(0, reading.peak_bytes - before), reading.kind, reading.note


def attention_table(rows: list[AttentionBenchRow]) -> str:
    """A markdown table of the rows, with each row's peak memory relative to ``naive``'s."""
    naive_peak = {
        (r.tokens, r.heads, r.head_dim, r.dtype, r.device): r.peak_memory_bytes
        for r in rows
        if r.backend == "naive" and r.status == STATUS_OK
    }
    table = []
    for r in rows:
        if r.status != STATUS_OK:
            cells = ["—"] * 4
        else:
            reference = naive_peak.get((r.tokens, r.heads, r.head_dim, r.dtype, r.device))
            ratio = f"{reference / r.peak_memory_bytes:.1f}x" if reference and r.peak_memory_bytes else "—"
            cells = [f"{r.mean_s * 1e3:.2f}", f"{format_mib(r.peak_memory_bytes)} {MEMORY_LABELS[r.memory_kind]}", ratio, f"{r.max_abs_error:.1e}"]
        status = r.status if not r.reason else f"{r.status}: {r.reason}"
        table.append([r.backend, r.tokens, f"{r.heads} x {r.head_dim}", r.dtype, r.device, *cells, status])
    headers = ["backend", "tokens", "heads x dim", "dtype", "device", "mean ms", "peak MiB", "naive peak / peak", "max abs err vs naive", "status"]
    return "\n".join(markdown_table(headers, table, right={1, 5, 6, 7, 8}))


def _inputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randn(1, heads, tokens, head_dim, generator=generator).to(device, dtype) for _ in range(3)]


def _parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in COMPUTE_DTYPES:
        raise UserError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]
