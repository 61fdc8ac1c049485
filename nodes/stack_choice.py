"""The stacks sdopt Auto chooses among, as data, and the choice itself: from what the device offers,
what the model is and each candidate's predicted memory, the fastest stack that fits the budget.

A stack is a list of single sdopt nodes with their widget values, applied in that order, so Auto runs
exactly what a user would wire by hand. Speeds behind the order (docs/benchmarks.md): on a GPU,
Precision → Attention → Compile → CUDA Graph is the fastest exact stack on every family (with
channels-last conv weights where the model has convolutions); on a CPU, Compile alone is (the graph
node has nothing to capture there, and Precision keeps fp32). Low Memory trades speed for working
memory, Offload trades it for weight memory. Step Cache changes the image, so only
``allow_approximate`` adds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..measure.memory_model import PLANNER_TOLERANCE
from ..optim.step_cache import StepCacheConfig

GOALS = ("fastest", "balanced", "fit")
MIB = 2**20
LOW_MEMORY_BUDGET_MB = {"fastest": 256, "balanced": 256, "fit": 64}
# Below this much of a UNet's weights kept resident, budget offload streams nearly every layer anyway.
MIN_RESIDENT_MB = 256
# A CUDA graph keeps its step's activations in a private pool between replays, beside what the
# allocator caches for the eager calls around it: counted as a second working peak.
GRAPH_POOLS = 2


@dataclass(frozen=True)
class NodeStep:
    """One single node of a stack: its class name and its widget values, in its function's order."""

    node: str
    inputs: tuple[tuple[str, object], ...]
    label: str

    def values(self) -> dict:
        return dict(self.inputs)


@dataclass(frozen=True)
class Stack:
    """A candidate: its steps in wiring order. ``low_memory``: its step runs through Low Memory (predicted
    so); ``holds_graph``: it captures CUDA graphs; ``offload_mb``: the UNet weights it keeps resident (None:
    all; 0: streamed layer by layer)."""

    name: str
    steps: tuple[NodeStep, ...]
    exact: bool = True
    low_memory: bool = False
    holds_graph: bool = False
    offload_mb: int | None = None

    def describe(self) -> str:
        return " → ".join(step.label for step in self.steps) or "no node"


@dataclass(frozen=True)
class DeviceFacts:
    """What the choice needs to know of the device and the model. ``compile_problem`` and
    ``graph_problem``: why Compile or CUDA Graph cannot run here (None where they can);
    ``has_convs``: the diffusion model has convolution weights (channels-last pays);
    ``cache_mode``: the Step Cache mode that fits the model (deepcache for a UNet, first_block for a
    transformer with block groups); ``budget_bytes``: the memory the run may use on the device."""

    cuda: bool
    compile_problem: str | None
    graph_problem: str | None
    has_convs: bool
    cache_mode: str
    weights_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class StepPrediction:
    """A candidate's predicted step: its working peak (what the process holds for it: on a CPU, as the
    heap keeps it resident), the bytes of its inputs, and its working peak as allocated (what
    ``measure.profiler.allocated_growth`` reads)."""

    working_bytes: int
    input_bytes: int
    allocated_bytes: int


@dataclass
class Choice:
    stack: Stack
    need_bytes: int | None  # predicted: resident weights, inputs and working memory of the step
    reasons: list[str] = field(default_factory=list)
    ruled_out: list[tuple[str, int | None, str]] = field(default_factory=list)  # (stack, predicted need, why)


def _step(node: str, label: str, **inputs) -> NodeStep:
    return NodeStep(node, tuple(inputs.items()), label)


SDPA_ATTENTION = _step("SDOptAttention", "Attention(sdpa)", backend="sdpa", on_unavailable="fallback", slice_size=0, memory_budget_mb=32)


def _cache(facts: DeviceFacts) -> NodeStep:
    """Step Cache at its defaults, in the mode that fits the model."""
    interval, threshold = StepCacheConfig.interval, StepCacheConfig.threshold
    label = f"first_block, {threshold:g}" if facts.cache_mode == "first_block" else f"deepcache, interval {interval}"
    return _step("SDOptStepCache", f"Step Cache({label})", mode=facts.cache_mode, interval=interval, branch=0, start=0.0,
                 end=1.0, on_unavailable="fallback", threshold=threshold)


def _compile(mode: str = "compile") -> NodeStep:
    return _step("SDOptCompile", f"Compile({mode})", mode=mode, backend="inductor", compile_mode="default", dynamic=False,
                 fullgraph=False, on_unavailable="fallback")


def fast_stack(facts: DeviceFacts, approximate: bool) -> Stack:
    """The fastest exact stack this device runs, with Step Cache before Compile when ``approximate``."""
    cache = (_cache(facts),) if approximate else ()
    if not facts.cuda:
        compiled = () if facts.compile_problem else (_compile(),)
        return Stack("fast (CPU)", cache + compiled, exact=not approximate)
    precision = _step("SDOptPrecision", "Precision(auto" + (", channels_last)" if facts.has_convs else ")"), weight_dtype="auto",
                      compute_dtype="default", tf32=False, channels_last=facts.has_convs)
    steps = (precision, SDPA_ATTENTION, *cache)
    if facts.compile_problem:
        return Stack("fast (eager)", steps, exact=not approximate)
    # First Block Cache decides per call, which only regional compile runs beside; no graph can hold it.
    if approximate and facts.cache_mode == "first_block":
        return Stack("fast (regional compile)", steps + (_compile("compile_regional"),), exact=False)
    graph = () if facts.graph_problem else (_step("SDOptCUDAGraph", "CUDA Graph", max_graphs=4, on_unavailable="fallback"),)
    return Stack("fast", steps + (_compile(),) + graph, exact=not approximate, holds_graph=bool(graph))


def _low_memory_stack(facts: DeviceFacts, goal: str, approximate: bool, offload_mb: int | None = None) -> Stack:
    budget = LOW_MEMORY_BUDGET_MB[goal]
    steps = (_step("SDOptLowMemory", f"Low Memory({budget} MiB)", budget_mb=budget, sequential_cfg=True, chunk_ops=True),)
    if facts.cuda:
        steps = (_step("SDOptPrecision", "Precision(auto)", weight_dtype="auto", compute_dtype="default", tf32=False,
                       channels_last=False),) + steps
    if approximate:
        steps += (_cache(facts),)
    name = f"low memory {budget} MiB"
    if offload_mb is not None:
        mode = "budget" if offload_mb else "sequential"
        label = f"Offload(budget {offload_mb} MiB)" if offload_mb else "Offload(sequential)"
        steps += (_step("SDOptOffload", label, mode=mode, budget_mb=offload_mb, on_unavailable="fallback"),)
        name += f" + offload {'sequential' if not offload_mb else f'{offload_mb} MiB'}"
    return Stack(name, steps, exact=not approximate, low_memory=True, offload_mb=offload_mb)


def need_bytes(stack: Stack, step: StepPrediction, facts: DeviceFacts) -> int:
    """Memory the stack's step needs on the device: the weights it keeps there (none on a CPU, whose
    budget is what is free beside the loaded weights), its inputs and its working peak."""
    working = step.working_bytes * (GRAPH_POOLS if stack.holds_graph else 1)
    if not facts.cuda:
        return step.input_bytes + working
    weights = facts.weights_bytes if stack.offload_mb is None else min(facts.weights_bytes, stack.offload_mb * MIB)
    return weights + step.input_bytes + working


def _offload_mb(facts: DeviceFacts, step: StepPrediction) -> int:
    """The UNet weights budget offload can keep beside the step with the planner's tolerance; 0: stream."""
    spare = facts.budget_bytes - step.input_bytes - int(step.working_bytes * (1 + PLANNER_TOLERANCE))
    mb = max(spare, 0) // MIB
    return mb if mb >= MIN_RESIDENT_MB else 0


def choose_stack(facts: DeviceFacts, goal: str, allow_approximate: bool, predict) -> Choice:
    """The stack for one sampling run. ``predict(stack)`` gives a candidate's ``StepPrediction``, or None
    where it cannot be predicted. ``fastest`` takes the first candidate whose need fits the budget,
    ``balanced`` the first that fits with the planner's tolerance to spare, ``fit`` the least-memory
    one. Where nothing fits, the least-memory candidate runs and the choice says so."""
    if goal not in GOALS:
        raise ValueError(f"goal {goal!r} is not one of {', '.join(GOALS)}")
    margin = 1 + PLANNER_TOLERANCE if goal == "balanced" else 1.0
    fast = fast_stack(facts, allow_approximate)
    low = _low_memory_stack(facts, goal, allow_approximate)
    candidates = [low] if goal == "fit" else [fast, low]
    ruled_out: list[tuple[str, int | None, str]] = []
    if goal == "fit":
        ruled_out.append((fast.name, None, "goal fit takes the least-memory stack"))
    budget = facts.budget_bytes
    reasons = [f"budget {budget / MIB:,.0f} MiB"]
    if facts.compile_problem:
        reasons.append(f"no Compile: {facts.compile_problem}")
    elif facts.cuda and facts.graph_problem:
        reasons.append(f"no CUDA Graph: {facts.graph_problem}")
    if not facts.cuda and goal != "fit":
        reasons.append("on a CPU Compile alone is the fastest exact stack (Precision keeps fp32; no graph to capture)")
    last = None
    for stack in candidates:
        step = predict(stack)
        if step is None:
            return Choice(stack, None, reasons + ["no prediction could be made: the fastest candidate runs"], ruled_out)
        need = need_bytes(stack, step, facts)
        if need * margin <= budget:
            return Choice(stack, need, reasons, ruled_out)
        if facts.cuda and stack.low_memory and stack.offload_mb is None:
            offloaded = _low_memory_stack(facts, goal, allow_approximate, _offload_mb(facts, step))
            offloaded_need = need_bytes(offloaded, step, facts)
            ruled_out.append((stack.name, need, f"needs {need / MIB:,.0f} MiB with its weights resident"))
            if offloaded_need * margin <= budget:
                return Choice(offloaded, offloaded_need, reasons + ["the weights do not fit beside the step: offloaded"], ruled_out)
            stack, need = offloaded, offloaded_need
        else:
            ruled_out.append((stack.name, need, f"needs {need / MIB:,.0f} MiB" + (" with the tolerance" if margin > 1 else "")))
        last = (stack, need)
    stack, need = last
    ruled_out = [entry for entry in ruled_out if entry[0] != stack.name]
    return Choice(stack, need, reasons + [f"nothing is predicted to fit; the least-memory stack runs (needs {need / MIB:,.0f} MiB)"],
                  ruled_out)
