"""Where a sampling step's time goes: the device's busy time per step, from torch.profiler.

A step runs at the pace of whichever is slower: the host launching work (Python, kernel launches,
waits on the device) or the device running it. ``profile_device(fn, device)`` runs ``fn`` under
``torch.profiler`` and sums what the device did: on CUDA the union of kernel, memcpy and memset
intervals; on a CPU the union of aten op intervals and compiled-graph calls (inductor's C++ kernels
run inside those, unseen by the profiler), the rest of the wall being Python. Set beside
the unprofiled step time, the busy time says which side bounds the step: a device busy for nearly
all of the step is the limit, and only fewer or faster kernels help; a device idle for much of it
waits on the host, and capturing more of the step in a graph helps.

Each step's time is also split by what the work does (``op_category``): matmuls and convolutions,
attention, normalisation and elementwise, copies, fused compiled kernels, other, and the rest of the
step, the host's gaps (on a CPU, Python). On a CPU an op counts with its children (attention's own
matmuls are attention), and a compiled graph's extern kernels (matmuls, convolutions) count as ops
beside its fused kernels. Where compiled graphs ran, the ops that ran outside them (a graph break, or
work before and after the compiled forward) are named with their calls per step.

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

from .report import markdown_table

CUDA_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
CPU_SYNC = "aten::_local_scalar_dense"
COMPILED_GRAPH = "## Call CompiledFxGraph"  # inductor's range around a compiled graph's call
COMPILED_KERNELS = "inductor kernels (compiled graph)"
TOP_KERNELS = 5
OUTSIDE_GRAPHS = 8  # ops named that ran outside compiled graphs
FUSED, OTHER = "fused (compiled)", "other"
HOST_GAPS = "host gaps"
# A kernel's or op's category: the first whose words its lower-cased name contains.
OP_CATEGORIES = (
    (FUSED, ("triton_", "cpp_fused", COMPILED_GRAPH.lower())),
    ("attention", ("attention", "flash", "fmha", "softmax")),
    ("matmul", ("gemm", "aten::mm", "addmm", "bmm", "matmul", "aten::linear", "conv", "cutlass", "xmma", "nvjet", "scaled_mm", "mkldnn")),
    ("copies", ("copy", "memcpy", "memset", "aten::to", "contiguous", "clone", "aten::cat", "aten::stack", "index", "aten::pad")),
    ("normalisation, elementwise", ("norm", "elementwise", "vectorized", "reduce", "aten::add", "aten::mul", "aten::sub", "aten::div",
                                     "silu", "gelu", "sigmoid", "tanh", "exp", "rsqrt", "pow", "neg", "sin", "cos", "where", "clamp",
                                     "aten::sum", "aten::mean", "aten::lerp")),
)
DEVICE_BOUND = 0.9  # busy share of the step above which the device, not the host, sets the pace

# The categories as tables list them
CATEGORIES = ("matmul", "attention", "normalisation, elementwise", "copies", FUSED, OTHER)


def op_category(name: str) -> str:
    """What a kernel or op named ``name`` does, one of ``OP_CATEGORIES``' names or "other"."""
    lowered = name.lower()
    return next((category for category, words in OP_CATEGORIES if any(word in lowered for word in words)), OTHER)


@dataclass
class DeviceActivity:
    """What the device did in one profiled call: microseconds busy, activities, host syncs, the
    costliest kernels (CUDA) or ops (CPU) as (name, microseconds), the microseconds per
    ``op_category``, and, where compiled graphs ran, the ops outside them as (name, calls)."""

    device_type: str
    busy_us: float
    activities: int
    host_syncs: int
    top: list[tuple[str, float]] = field(default_factory=list)
    categories: dict[str, float] = field(default_factory=dict)
    outside_graphs: list[tuple[str, int]] | None = None

    def per_step(self, steps: int, step_wall_s: float) -> "StepBreakdown":
        """Spread over ``steps`` (the profiled call's setup counts in, a few per cent of a prompt)
        and set beside ``step_wall_s``, a step's time measured without the profiler's overhead."""
        busy_ms = self.busy_us / 1000 / steps
        wall_ms = step_wall_s * 1000
        busy_share = min(1.0, busy_ms / wall_ms) if wall_ms > 0 else 0.0
        # each category's share of the busy time, scaled to the step's busy share: they and the gaps make the step
        total = sum(self.categories.values())
        shares = sorted(((name, us / total * busy_share) for name, us in self.categories.items() if total), key=lambda c: -c[1])
        return StepBreakdown(
            device_type=self.device_type, wall_ms=wall_ms, busy_ms=busy_ms, busy_share=busy_share,
            activities_per_step=self.activities / steps, host_syncs=self.host_syncs,
            top=[(name, us / self.busy_us if self.busy_us else 0.0) for name, us in self.top],
            categories=[*shares, (HOST_GAPS, 1.0 - busy_share)],
            outside_graphs=None if self.outside_graphs is None else [(name, calls / steps) for name, calls in self.outside_graphs],
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
    categories: list[tuple[str, float]] = field(default_factory=list)  # (op_category or host gaps, its share of the step)
    outside_graphs: list[tuple[str, float]] | None = None  # (op, calls per step) outside compiled graphs, where any ran

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
    events = list(events)
    spans = [(e.time_range.start, e.time_range.end) for e in events if span is not None and e.name == span]

    def in_span(event) -> bool:
        return span is None or any(start <= event.time_range.start <= end for start, end in spans)

    work, syncs = [], 0
    for event in events:
        on_device = _on_device(event)
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
    by_name, categories, outside = Counter(), Counter(), None
    if device_type == "cuda":
        for event in work:
            by_name[event.name] += event.time_range.end - event.time_range.start
            categories[op_category(event.name)] += event.time_range.end - event.time_range.start
    else:  # nested ops would count twice: rank by the time each op spends outside its children
        for event in work:
            by_name[COMPILED_KERNELS if event.name.startswith(COMPILED_GRAPH) else event.name] += event.self_cpu_time_total
        categories = _cpu_categories(work)
    host_ops = [e for e in events if not _on_device(e) and e.name.startswith(("aten::", COMPILED_GRAPH))]
    if any(e.name.startswith(COMPILED_GRAPH) for e in host_ops):
        outside = Counter(e.name for e in _outermost(host_ops) if not e.name.startswith(COMPILED_GRAPH)).most_common(OUTSIDE_GRAPHS)
    busy = busy_union((e.time_range.start, e.time_range.end) for e in work)
    return DeviceActivity(device_type, busy, len(work), syncs, by_name.most_common(TOP_KERNELS), dict(categories), outside)


def _cpu_categories(work: list) -> Counter:
    """Microseconds per category of CPU ops: an op counts with its children (attention's matmuls are
    attention's); a compiled graph's own time is its fused kernels', its extern kernels (matmuls,
    convolutions) count as ops."""
    categories = Counter()
    for event in _outermost(work):
        if not event.name.startswith(COMPILED_GRAPH):
            categories[op_category(event.name)] += event.time_range.end - event.time_range.start
            continue
        categories[FUSED] += event.self_cpu_time_total
        inside = [e for e in work if e is not event and event.time_range.start <= e.time_range.start < event.time_range.end]
        for child in _outermost(inside):
            categories[op_category(child.name)] += child.time_range.end - child.time_range.start
    return categories


def _on_device(event) -> bool:
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CUDA


def _outermost(events: Iterable) -> list:
    """The events not nested in an earlier one (the profiler's ranges on a thread nest)."""
    kept, reach = [], float("-inf")
    for event in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        if event.time_range.start >= reach:
            kept.append(event)
            reach = event.time_range.end
    return kept


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


def step_profile_table(profiles: dict[str, dict]) -> str:
    """Per profiled run ({name: ``StepBreakdown.to_dict()``}): the step, the device's busy time in it,
    what bounds it, and the costliest kernels or ops; "" where none was profiled."""
    if not profiles:
        return ""
    cuda = next(iter(profiles.values()))["device_type"] == "cuda"
    unit, syncs = ("kernels", "host syncs") if cuda else ("aten ops", "value reads")
    headers = ["rung", "step ms", "device busy ms", "busy share", "bound by", f"{unit} per step", f"{syncs} while sampling", f"top {unit} (share of busy)"]
    body = [[name, f"{p['wall_ms']:.2f}", f"{p['busy_ms']:.2f}", f"{p['busy_share']:.0%}", p["bound_by"], f"{p['activities_per_step']:.0f}",
             str(p["host_syncs"]), "; ".join(f"{op[:48]} {share:.0%}" for op, share in p["top"][:3])]
            for name, p in profiles.items()]
    return "\n".join(markdown_table(headers, body, right={1, 2, 3, 5, 6}))


def step_category_table(profiles: dict[str, dict]) -> str:
    """Per profiled run: each op category's share of the step, the host's gaps, and the ops that ran
    outside compiled graphs (calls per step), where any ran; "" where none was profiled."""
    if not profiles:
        return ""
    names = [*CATEGORIES, HOST_GAPS]
    headers = ["rung", "step ms", *names, "ops outside compiled graphs (calls per step)"]
    body = []
    for name, profile in profiles.items():
        shares, outside = dict(profile["categories"]), profile["outside_graphs"]
        body.append([name, f"{profile['wall_ms']:.2f}", *(f"{shares.get(category, 0.0):.0%}" for category in names),
                     "no compiled graph" if outside is None else "; ".join(f"{op} {calls:g}" for op, calls in outside) or "none"])
    return "\n".join(markdown_table(headers, body, right=set(range(1, len(names) + 2))))
