"""Where a sampling step's time goes: the device's busy time per step, from torch.profiler.

A step runs at the pace of whichever is slower: the host launching work (Python, kernel launches,
waits on the device) or the device running it. ``profile_device(fn, device)`` runs ``fn`` under
``torch.profiler`` and sums what the device did: on CUDA the union of kernel, memcpy and memset
intervals; on a CPU the union of aten op intervals and compiled-graph calls (inductor's C++ kernels
run inside those, unseen by the profiler), the rest of the wall being Python. Set beside
the unprofiled step time, the busy time says which side bounds the step: a device busy for nearly
all of the step is the limit, and only fewer or faster kernels help; a device idle for much of it
waits on the host, and capturing more of the step in a graph helps.

Host syncs are the calls that make the host wait for the device (``cudaStreamSynchronize`` and
kin). One per step keeps the host from running ahead. A CPU has no device to wait for: there the
count is of the reads of a tensor's value (``aten::_local_scalar_dense``: ``item()``, ``float(t)``),
each a sync where that tensor lives on a GPU; a traced model's shape arithmetic reads CPU scalars,
which never sync. Only those inside the ``span``
ranges (``record_function`` names) count, so that a prompt's set-up (a sigma schedule read value by
value) is not taken for the loop's.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CUDA_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
CPU_SYNC = "aten::_local_scalar_dense"
COMPILED_GRAPH = "## Call CompiledFxGraph"  # inductor's range around a compiled graph's call
COMPILED_KERNELS = "inductor kernels (compiled graph)"
TOP_KERNELS = 5
DEVICE_BOUND = 0.9  # busy share of the step above which the device, not the host, sets the pace


@dataclass
class DeviceActivity:
    """What the device did in one profiled call: microseconds busy, activities, host syncs, and the
    costliest kernels (CUDA) or ops (CPU) as (name, microseconds)."""

    device_type: str
    busy_us: float
    activities: int
    host_syncs: int
    top: list[tuple[str, float]] = field(default_factory=list)

    def per_step(self, steps: int, step_wall_s: float) -> "StepBreakdown":
        """Spread over ``steps`` (the profiled call's setup counts in, a few per cent of a prompt)
        and set beside ``step_wall_s``, a step's time measured without the profiler's overhead."""
        busy_ms = self.busy_us / 1000 / steps
        wall_ms = step_wall_s * 1000
        return StepBreakdown(
            device_type=self.device_type, wall_ms=wall_ms, busy_ms=busy_ms,
            busy_share=min(1.0, busy_ms / wall_ms) if wall_ms > 0 else 0.0,
            activities_per_step=self.activities / steps, host_syncs=self.host_syncs,
            top=[(name, us / self.busy_us if self.busy_us else 0.0) for name, us in self.top],
        )


@dataclass
class StepBreakdown:
    """One sampling step: its wall time (unprofiled), the device's busy time in it, and what bounds it."""

    device_type: str
    wall_ms: float
    busy_ms: float
    busy_share: float
    activities_per_step: float
    host_syncs: int
    top: list[tuple[str, float]]  # (kernel or op, its share of the busy time)

    @property
    def bound_by(self) -> str:
        """On CUDA "device" or "host"; on a CPU, which is both, "ops" or "Python"."""
        device_bound = self.busy_share >= DEVICE_BOUND
        if self.device_type == "cuda":
            return "device" if device_bound else "host"
        return "ops" if device_bound else "Python"

    def to_dict(self) -> dict:
        return asdict(self) | {"bound_by": self.bound_by}


def busy_union(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: nested or overlapping time counts once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(events: Iterable, device_type: str, span: str | None = None) -> DeviceActivity:
    """``DeviceActivity`` from profiler events (``name``, ``device_type``, ``time_range`` in µs);
    with ``span``, host syncs count only inside the ranges of that name."""
    from torch.autograd import DeviceType

    events = list(events)
    spans = [(e.time_range.start, e.time_range.end) for e in events if span is not None and e.name == span]

    def in_span(event) -> bool:
        return span is None or any(start <= event.time_range.start <= end for start, end in spans)

    work, syncs = [], 0
    for event in events:
        on_device = event.device_type == DeviceType.CUDA
        if device_type == "cuda":
            if on_device:
                work.append(event)
            elif event.name in CUDA_SYNCS:
                syncs += in_span(event)
        elif not on_device:
            if event.name == CPU_SYNC:
                syncs += in_span(event)
            elif event.name.startswith(("aten::", COMPILED_GRAPH)):
                work.append(event)
    by_name = Counter()
    if device_type == "cuda":
        for event in work:
            by_name[event.name] += event.time_range.end - event.time_range.start
    else:  # nested ops would count twice: rank by the time each op spends outside its children
        for event in work:
            by_name[COMPILED_KERNELS if event.name.startswith(COMPILED_GRAPH) else event.name] += event.self_cpu_time_total
    busy = busy_union((e.time_range.start, e.time_range.end) for e in work)
    return DeviceActivity(device_type, busy, len(work), syncs, by_name.most_common(TOP_KERNELS))


def profile_device(
    fn: Callable[[], Any], device: torch.device | str, trace_path: Path | None = None, span: str | None = None,
) -> tuple[Any, DeviceActivity]:
    """``fn()`` under torch.profiler: its result and what ``device`` did while it ran (host syncs
    inside ``span`` ranges only, where given); with ``trace_path``, a Chrome/Perfetto trace too
    (gzipped where the name ends in .gz)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return result, summarize(prof.events(), device.type, span)
