"""Automatic attention selection: per input signature, time every available exact backend on the
real inputs (at most ``TRIAL_QUERY_ROWS`` of their query rows, every key), turn down any whose output
differs from ``naive`` beyond the dtype's tolerance, and keep the fastest whose whole call, on those
rows of its output, is within it too (backends that quantize inside are never candidates: a user
picks those by name; those that hold the whole score matrix only where it fits in half the device's
free memory, at the whole call's size). Every candidate is checked against one ``naive_reference``
of the trial rows per signature. The call that decides returns the output its decision already
computed (the pick's check on a whole trial, its whole call otherwise): no attention runs twice.
``build_attention(AttentionConfig(backend="auto"))`` returns an ``AutoAttention``."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import UserError
from ..device import free_memory
from .backends import AttentionConfig, available, backend_names, get_backend
from .config import (
    AUTO,
    DEFAULT_MEMORY_BUDGET_BYTES,
    SCORE_COPIES,
    TOLERANCE_FP32,
    TOLERANCES,
    AttentionFn,
    Tolerance,
    compute_dtype,
    dtype_name,
)
from .kernels import mask_view, naive_attention, sliced_slice_size
from .per_signature import AttentionDecision, Decided, PerSignature

AUTO_REPEATS = 3
# A backend that holds the whole query-by-key score matrix (naive, sdpa_math) is tried only where it takes
# at most this share of what the device has free: at SD1.5's 1024² the first level's scores are 32 GiB in
# fp32 with CFG, and auto's trial must never be what runs a machine out of memory.
QUADRATIC_TRIAL_SHARE = 0.5
# Attention's cost grows with its query rows at a fixed key count, so a sample of the rows ranks the
# backends at a fraction of the cost: at SD1.5's 1024² (16,384 rows) each trial costs a sixteenth.
TRIAL_QUERY_ROWS = 1024

# --- checking and timing -----------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceCheck:
    max_abs_error: float
    ok: bool
    reason: str = ""


def _row_blocks(q: torch.Tensor, k: torch.Tensor, memory_budget_bytes: int) -> list[slice]:
    """Blocks of query rows whose scores fit ``memory_budget_bytes``."""
    batch, heads, q_tokens, _ = q.shape
    block = sliced_slice_size(batch * heads, k.shape[2], compute_dtype(q.dtype).itemsize, memory_budget_bytes)
    return [slice(i, i + block) for i in range(0, q_tokens, block)]


def _naive_rows(q, k, v, mask, rows: slice) -> torch.Tensor:
    return naive_attention(q[:, :, rows], k, v, None if mask is None else mask_view(mask, queries=rows)).float()


def naive_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
) -> torch.Tensor:
    """``naive``'s output for these inputs in fp32, one block of query rows at a time so the full score
    matrix never exists: computed once where several outputs are checked against it."""
    return torch.cat([_naive_rows(q, k, v, mask, rows) for rows in _row_blocks(q, k, memory_budget_bytes)], dim=2)


def check_against_naive(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    tolerance: Tolerance | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    reference: torch.Tensor | None = None,
) -> ReferenceCheck:
    """Compare ``out`` with ``naive`` on every query row, one block of rows at a time so the
    reference never holds the full score matrix; ``reference``: ``naive_reference`` of these inputs,
    where the caller already has it. The tolerance defaults to the dtype's."""
    tolerance = tolerance or TOLERANCES.get(q.dtype, TOLERANCE_FP32)
    expected = (*q.shape[:3], v.shape[-1])
    if tuple(out.shape) != expected:
        return ReferenceCheck(math.inf, False, f"output shape {list(out.shape)} instead of {list(expected)}")
    worst, within = 0.0, True
    for rows in _row_blocks(q, k, memory_budget_bytes):
        reference_rows = _naive_rows(q, k, v, mask, rows) if reference is None else reference[:, :, rows]
        got = out[:, :, rows].float()
        error = (got - reference_rows).abs()
        # NaN where the reference has NaN too (fully masked rows) is agreement; elsewhere it is wrong.
        error = torch.where(reference_rows.isnan() & got.isnan(), 0.0, error.nan_to_num(nan=math.inf))
        worst = max(worst, error.max().item())
        within = within and bool((error <= tolerance.atol + tolerance.rtol * reference_rows.abs().nan_to_num()).all())
    if within:
        return ReferenceCheck(worst, True)
    return ReferenceCheck(
        worst, False, f"max abs error {worst:.2e} vs naive exceeds the {dtype_name(q.dtype)} tolerance ({tolerance.describe()})"
    )


def time_attention(
    fn: AttentionFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    repeats: int = AUTO_REPEATS,
) -> list[float]:
    """Seconds of each of ``repeats`` calls, the device synchronized around each so queued work counts."""
    synchronize = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
    seconds = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        fn(q, k, v, mask)
        synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def _scores_past_free_memory(q: torch.Tensor, k: torch.Tensor) -> str:
    """Why a backend that holds the score matrix is not tried on these inputs, or "" where it fits."""
    batch, heads, q_tokens, _ = q.shape
    scores = SCORE_COPIES * batch * heads * q_tokens * k.shape[2] * compute_dtype(q.dtype).itemsize
    free = free_memory(q.device)
    if scores <= QUADRATIC_TRIAL_SHARE * free:
        return ""
    return (f"not tried: its query-by-key scores would take {scores / 2**20:,.1f} MiB, more than "
            f"{QUADRATIC_TRIAL_SHARE:.0%} of the {free / 2**20:,.1f} MiB free on {q.device}")


@dataclass(frozen=True)
class TrialRows:
    """The query rows a decision times and checks its candidates on: every row up to ``TRIAL_QUERY_ROWS``,
    past it an even stride through the whole sequence, so that every part of it (and of a mask) is
    checked, with every key kept."""

    total: int
    stride: int

    @classmethod
    def of(cls, q: torch.Tensor) -> TrialRows:
        total = q.shape[2]
        return cls(total, max(1, math.ceil(total / TRIAL_QUERY_ROWS)))

    @property
    def is_whole(self) -> bool:
        return self.stride == 1

    @property
    def rows(self) -> slice:
        return slice(None, None, self.stride)

    @property
    def count(self) -> int:
        return math.ceil(self.total / self.stride)

    def inputs(self, q: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trial's queries (dense, as a backend is handed them in a real call) and its part of the mask."""
        if self.is_whole:
            return q, mask
        return q[:, :, self.rows].contiguous(), None if mask is None else mask_view(mask, queries=self.rows).contiguous()


class AutoAttention(PerSignature):
    """Times every available exact backend on the first real inputs of each signature (``TrialRows``
    of them) and keeps the fastest whose output matches ``naive`` within the dtype's tolerance, there
    and on the same rows of its whole call.

    ``candidates`` defaults to every registered backend at the time of the decision.
    """

    def __init__(
        self,
        config: AttentionConfig | None = None,
        on_decision: Callable[[AttentionDecision], None] | None = None,
        candidates: tuple[str, ...] | None = None,
        repeats: int = AUTO_REPEATS,
    ):
        super().__init__(config or AttentionConfig(backend=AUTO), on_decision)
        self.candidates = candidates
        self.repeats = repeats

    def _decide(self, key, q, k, v, mask) -> Decided:
        trial = TrialRows.of(q)
        q_trial, mask_trial = trial.inputs(q, mask)
        times: dict[str, float] = {}
        rejected: dict[str, str] = {}
        reference = None
        fastest_out = None  # on a whole trial, the fastest candidate's checked output so far: the call's own
        for name in self.candidates or backend_names():
            backend = get_backend(name)
            if backend.low_precision:
                rejected[name] = f"quantizes inside ({backend.description}); auto keeps exact backends, choose {name} by name to run it"
                continue
            verdict = available(name, q, k, v, mask)
            if not verdict.ok:
                rejected[name] = verdict.reason
                continue
            if backend.linear_memory is False:
                too_big = _scores_past_free_memory(q, k)
                if too_big:
                    rejected[name] = too_big
                    continue
            fn = self._function(name)
            try:
                if reference is None:
                    reference = naive_reference(q_trial, k, v, mask_trial, self.config.memory_budget_bytes)
                out = fn(q_trial, k, v, mask_trial)
                check = self._check(out, q_trial, k, v, mask_trial, reference)
                if not check.ok:
                    rejected[name] = check.reason
                    continue
                times[name] = statistics.median(time_attention(fn, q_trial, k, v, mask_trial, self.repeats))
            except Exception as error:  # a backend that cannot run these inputs is turned down, not fatal
                rejected[name] = f"failed: {type(error).__name__}: {_first_line(error)}"
                continue
            if trial.is_whole and all(times[name] < seconds for other, seconds in times.items() if other != name):
                fastest_out = out
        for picked in sorted(times, key=times.__getitem__):
            out, problem = (fastest_out, "") if trial.is_whole else self._whole_call(picked, q, k, v, mask, trial, q_trial, mask_trial, reference)
            if not problem:
                return AttentionDecision(key, AUTO, picked, _auto_note(key, picked, times, trial), times, rejected), out
            rejected[picked] = problem
            del times[picked]
        details = "; ".join(f"{name}: {reason}" for name, reason in rejected.items())
        raise UserError(f"auto attention found no backend for {key} ({details})")

    def _check(self, out, q, k, v, mask, reference) -> ReferenceCheck:
        return check_against_naive(out, q, k, v, mask, memory_budget_bytes=self.config.memory_budget_bytes, reference=reference)

    def _whole_call(self, name: str, q, k, v, mask, trial: TrialRows, q_trial, mask_trial, reference) -> tuple[torch.Tensor | None, str]:
        """The fastest backend on the trial rows, run once on every row (its kernel may differ at the
        whole size) with its trial rows checked: (its output, "") where it holds, else (None, why not)."""
        try:
            out = self._function(name)(q, k, v, mask)
        except Exception as error:  # as in the trials: turned down, and the next fastest is tried
            return None, f"failed on all {trial.total:,} query rows: {type(error).__name__}: {_first_line(error)}"
        check = self._check(out[:, :, trial.rows], q_trial, k, v, mask_trial, reference)
        return (out, "") if check.ok else (None, f"on all {trial.total:,} query rows: {check.reason}")


def _auto_note(key: str, picked: str, times: dict[str, float], trial: TrialRows) -> str:
    ranked = sorted(times.items(), key=lambda item: item[1])
    others = ", ".join(f"{name} {seconds * 1e3:.3g}" for name, seconds in ranked if name != picked)
    note = f"{key}: {picked} {times[picked] * 1e3:.3g} ms"
    if others:
        note += f" (then {others})"
    if not trial.is_whole:
        note += f", timed on {trial.count:,} of its {trial.total:,} query rows"
    return note


def _first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""
