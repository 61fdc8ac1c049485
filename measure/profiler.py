"""Measure sampling runs: step times, peak memory, and the optimization records they ran with.

Host-independent: a host (the ComfyUI nodes, a diffusers loop, the benches) drives a
``SamplingRun`` through ``memory_scope``/``start``/``step``/``finish`` and gets a
``RunResult``. Timing uses CUDA events on CUDA and ``perf_counter`` elsewhere; peak
memory is the CUDA allocator's peak on CUDA and the process peak RSS (VmHWM) on CPU. Where a host
maps device memory past the allocator (ComfyUI 0.38's dynamic VRAM), it passes a probe of that
memory, sampled at the start, every step and the end, and the run reports its peak beside.

The steady rate leaves out the first step and every step marked warm-up: a host that compiles or
captures a CUDA graph during a step says so through ``warm_up``, and that step stays in the step
list with the seconds it spent, apart from the steady rate.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

MEMORY_VRAM = "vram_allocated"
MEMORY_RAM = "ram_rss"
MEMORY_LABELS = {MEMORY_VRAM: "VRAM", MEMORY_RAM: "RAM"}
MIB = 2**20

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def format_mib(n: int | None) -> str:
    """Bytes as MiB with one decimal and thousands separators; "-" when unknown."""
    return "-" if n is None else f"{n / MIB:,.1f}"


def proc_status_bytes(field_name: str) -> int:
    """A size field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes (Linux)."""
    for line in _PROC_STATUS.read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} in {_PROC_STATUS}")


def peak_rss_growth(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """Run ``fn`` with the process's peak RSS reset first (Linux): its result, the peak RSS while it
    ran, and that peak's growth over the RSS at its start."""
    _PROC_CLEAR_REFS.write_text("5")
    before = proc_status_bytes("VmRSS")
    result = fn()
    peak = proc_status_bytes("VmHWM")
    return result, peak, peak - before


def allocated_growth(device: torch.device | str, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """Run ``fn``: its result, and the most bytes its allocations held at once above what was allocated at
    its start. On CUDA the caching allocator's peak; elsewhere every allocation and free that PyTorch's CPU
    allocator saw (its tensors and the kernels' scratch, oneDNN's reorders included), from the profiler's
    memory events in the order they happened: what the tensors took, before the heap keeps any of it.
    None on a CPU while a profiler already runs (sdopt's step profile, the user's): one cannot nest."""
    device = torch.device(device)
    if device.type == "cuda":
        memory = PeakMemory(device)
        memory.reset()
        before = torch.cuda.memory_allocated(device)
        result = fn()
        return result, memory.read().peak_bytes - before
    if torch.autograd.profiler._is_profiler_enabled:
        return fn(), None
    # Kineto logs a line per profile at its default level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        result = fn()
    events = sorted((event.start_ns(), event.nbytes()) for event in profile.profiler.kineto_results.events()
                    if event.name() == "[memory]" and event.device_type().name == "CPU")
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return result, peak


def _peak_rss_bytes() -> int:
    if _PROC_STATUS.exists():
        return proc_status_bytes("VmHWM")
    # ru_maxrss is KiB on Linux and bytes on macOS, and it cannot be reset.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_peak_rss() -> bool:
    """Lower VmHWM to the current RSS ("5" resets it); False where the kernel refuses."""
    try:
        _PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int
    kind: str
    reserved_bytes: int | None = None
    note: str = ""
    outside_allocator_bytes: int | None = None


class PeakMemory:
    """Peak memory on one device since ``reset()``: VRAM on CUDA, process RSS otherwise; plus the
    peak of ``outside_allocator()`` (bytes mapped past PyTorch's allocator) over ``sample()`` calls."""

    def __init__(self, device: torch.device | str, outside_allocator: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self.kind = MEMORY_VRAM if self.device.type == "cuda" else MEMORY_RAM
        self._note = ""
        self._outside_allocator = outside_allocator
        self._outside_peak: int | None = None

    def sample(self) -> None:
        if self._outside_allocator is not None:
            self._outside_peak = max(self._outside_peak or 0, self._outside_allocator())

    def reset(self) -> None:
        self._outside_peak = None
        self.sample()
        if self.kind == MEMORY_VRAM:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not _reset_peak_rss():
            self._note = "peak RSS could not be reset; it covers the whole process"

    def read(self) -> MemoryReading:
        self.sample()
        if self.kind == MEMORY_VRAM:
            torch.cuda.synchronize(self.device)
            return MemoryReading(
                peak_bytes=torch.cuda.max_memory_allocated(self.device),
                kind=self.kind,
                reserved_bytes=torch.cuda.max_memory_reserved(self.device),
                outside_allocator_bytes=self._outside_peak,
            )
        return MemoryReading(peak_bytes=_peak_rss_bytes(), kind=self.kind, note=self._note, outside_allocator_bytes=self._outside_peak)


class Timeline:
    """Marks on a device's timeline; ``intervals()`` gives the seconds between them.

    On CUDA the marks are events on the current stream, so marking never blocks and
    only ``intervals()`` synchronizes. Elsewhere they are ``perf_counter`` readings.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._marks: list = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def __len__(self) -> int:
        return len(self._marks)

    def intervals(self) -> list[float]:
        if len(self._marks) < 2:
            return []
        if self.device.type == "cuda":
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


@dataclass
class RunResult:
    label: str
    sampler_total_s: float
    first_step_s: float
    steady_it_per_s: float | None
    steps: list[dict]
    peak_memory_bytes: int
    memory_kind: str
    peak_reserved_bytes: int | None = None
    memory_note: str = ""
    optimizations: list[dict] = field(default_factory=list)
    peak_outside_allocator_bytes: int | None = None
    steady_steps: list[int] = field(default_factory=list)
    model_family: str | None = None
    speed_only_nodes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def steady_steps(step_count: int, warmup: Collection[int] = ()) -> list[int]:
    """The steps a steady rate is measured on: those after the first that are not warm-up; where
    there are none, the first step unless it is warm-up itself; else none."""
    later = [i for i in range(1, step_count) if i not in warmup]
    return later or ([0] if step_count and 0 not in warmup else [])


def steady_it_per_s(step_seconds: list[float], warmup: Collection[int] = ()) -> float | None:
    """Iterations per second over ``steady_steps``; None where no step is left to measure."""
    chosen = steady_steps(len(step_seconds), warmup)
    total = sum(step_seconds[i] for i in chosen)
    return len(chosen) / total if total > 0 else None


class SamplingRun:
    """One sampling run: a memory scope around a timed sampler with per-step marks.

    Use ``with run.memory_scope():`` around everything whose memory counts (model load
    included), then ``start()``, ``step()`` after each sampler step, and ``finish()``.
    The sampler total runs from ``start()`` to ``finish()``; step ``i`` runs from the
    previous mark to the ``i``-th ``step()``, so the total is never below the step sum.
    ``model_family`` names the family of the sampled model, where the host knows it.
    """

    def __init__(self, label: str, device: torch.device | str, optimizations=(), outside_allocator: Callable[[], int] | None = None,
                 model_family: str | None = None):
        self.label = label
        self.model_family = model_family
        self.device = torch.device(device)
        self.memory = PeakMemory(self.device, outside_allocator)
        self.optimizations: list[dict] = [dict(o) for o in optimizations]
        self._timeline = Timeline(self.device)
        self._step_marks = 0
        self._warmup: dict[int, dict[str, float]] = {}
        # nodes whose work leaves the output as eager's (compile, graphs): a run without them is the eager twin
        self.speed_only_nodes: set[str] = set()
        self._reading: MemoryReading | None = None
        self._finished = False

    @contextlib.contextmanager
    def memory_scope(self):
        self.memory.reset()
        token = _active_run.set(self)
        try:
            yield self
        finally:
            _active_run.reset(token)
            self._reading = self.memory.read()

    def start(self) -> None:
        self._timeline.mark()

    def step(self) -> None:
        self._timeline.mark()
        self._step_marks += 1
        self.memory.sample()

    def warm_up(self, kind: str, seconds: float) -> None:
        """Mark the step in progress as warm-up: it spent ``seconds`` on ``kind`` (``compile``,
        ``capture``), so the steady rate leaves it out."""
        spent = self._warmup.setdefault(self._step_marks, {})
        spent[kind] = spent.get(kind, 0.0) + seconds

    def finish(self) -> None:
        self._timeline.mark()
        self._finished = True

    @property
    def finished(self) -> bool:
        return self._finished

    def result(self) -> RunResult:
        if not self._finished:
            raise RuntimeError(f"run {self.label!r} has not finished")
        intervals = self._timeline.intervals()
        steps = intervals[: self._step_marks]
        reading = self._reading or self.memory.read()
        return RunResult(
            label=self.label,
            sampler_total_s=sum(intervals),
            first_step_s=steps[0] if steps else 0.0,
            steady_it_per_s=steady_it_per_s(steps, self._warmup),
            steps=[{"index": i, "seconds": s, "warmup": dict(self._warmup.get(i, {}))} for i, s in enumerate(steps)],
            peak_memory_bytes=reading.peak_bytes,
            memory_kind=reading.kind,
            peak_reserved_bytes=reading.reserved_bytes,
            memory_note=reading.note,
            optimizations=[dict(o) for o in self.optimizations],
            peak_outside_allocator_bytes=reading.outside_allocator_bytes,
            steady_steps=steady_steps(len(steps), self._warmup),
            model_family=self.model_family,
            speed_only_nodes=sorted(self.speed_only_nodes),
        )


_active_run: contextvars.ContextVar[SamplingRun | None] = contextvars.ContextVar("sdopt_active_run", default=None)


def active_run() -> SamplingRun | None:
    """The run whose memory scope is open in this context, if any."""
    return _active_run.get()


@contextlib.contextmanager
def outside_any_run():
    """A scope in which no run is active: work done for a run but not part of it (a prediction on fake
    tensors, a probe) files nothing into it."""
    token = _active_run.set(None)
    try:
        yield
    finally:
        _active_run.reset(token)

