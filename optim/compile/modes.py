"""The three modes as objects: ``MODE_OBJECTS`` maps each mode's name to its ``CompileMode``, which
knows whether it can run here, how it sets up and runs a ``CompiledForward``, and its wording in the
settings (the cache key) and in the record. Weights stay inputs in every mode:

- ``compile`` (``WHOLE``): the whole forward through ``torch.compile``; dynamo lifts parameters to
  graph inputs, so replaced weights are read, not baked in;
- ``compile_regional`` (``REGIONAL``): each block class is compiled once and shared by its instances
  (their ``forward`` is bound to the compiled one only while the call runs). The blocks are those of
  the classes ``block_classes`` names (the model family's repeated blocks), a class that occurs once
  included; with none named or found, every composite class that occurs at least twice. Dynamo keeps
  weight shapes static, so instances of one class whose weights differ in shape compile apart; what
  a block is handed besides tensors goes through ``block_options`` first, where a host leaves out what
  differs per block (ComfyUI's block position), so that alike blocks share one compiled entry;
- ``trace`` (``TRACE``): one trace per input signature, taking the weights as inputs, so replaced
  weights need no new trace; with ``freeze`` (weights folded in as constants) the trace is redone,
  which the stats say.

A mode holds no state of its own: what it sets up for one model (compiled code, blocks, traces) lives
on that model's ``CompiledForward``, which hands its calls to ``config.kind``.
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ...errors import Unavailable
from ..cuda_graph import input_signature
from .private_code import with_private_code

# What a mode is given: the forward's ``CompileConfig`` (``config.py``) and ``CompiledForward``
# (``forward.py``), both of which look their mode up here.
Config = Any
Forward = Any


class CompileMode:
    """One mode: how a ``CompiledForward`` sets up and runs, what it needs, how it is worded."""

    name: str
    # the forward's own Python code still runs; only the repeated blocks are compiled
    compiles_blocks_only: bool = False
    # sdopt's ArtifactCache keeps what it compiles
    uses_compile_cache: bool = True
    # what ComfyUI's graph-breaking attention (on a CPU it asks psutil for free memory) would do to
    # this mode's code, in the note of the Compile node that routes it through sdpa instead
    host_attention_cost: str = "breaks torch.compile's graph"
    # dynamo compiles it, so graphs another compiled model made can run in it (the forward's watch)
    compiles_with_dynamo: bool = True
    # torch.compile's ``dynamic`` where the config does not ask for dynamic shapes
    dynamic_unasked: bool | None = False
    # the record's wording of when and how it compiles
    setup_note: str = "compiles on the first steps"

    def block_classes(self, repeated_blocks: tuple[str, ...]) -> tuple[str, ...]:
        """The block classes it compiles one by one, of the model family's ``repeated_blocks``."""
        return ()

    def settings(self, config: Config) -> str:
        """The settings' wording, in the record and sdopt's cache key."""
        raise NotImplementedError

    def unavailable(self, config: Config, device: torch.device) -> Unavailable | None:
        """Why ``config`` cannot run on ``device`` here and the fix that fits, or None when it can."""
        raise NotImplementedError

    def uses_inductor(self, config: Config) -> bool:
        """Whether inductor compiles its code: it converts NCHW conv weights and probes a CPU's vector
        instructions."""
        raise NotImplementedError

    def meets_recompile_limit(self, config: Config) -> bool:
        """Whether dynamo's recompile limit turns away a new input signature past it (which then runs
        eagerly, before dynamo is asked)."""
        return False

    def build(self, forward: Forward) -> None:
        """Set up what ``forward`` compiles (its private code copies in ``forward._codes``)."""

    def run(self, forward: Forward, inputs: tuple):
        """``forward.call(forward.module, *inputs)`` through what it compiled."""
        raise NotImplementedError


class _Dynamo(CompileMode):
    """What the ``torch.compile`` modes share."""

    def settings(self, config: Config) -> str:
        return f"{self.name}-{config.backend}-{config.compile_mode}{'-dynamic' if config.dynamic else ''}{'-fullgraph' if config.fullgraph else ''}"

    def unavailable(self, config: Config, device: torch.device) -> Unavailable | None:
        return config.backend_unavailable(device)

    def uses_inductor(self, config: Config) -> bool:
        return config.backend == "inductor"


# --- compile: the whole forward ----------------------------------------------------------------------


def _whole(module: torch.nn.Module, call: Callable) -> Callable:
    """``call(module, *inputs)`` as a function of the inputs alone: what the whole-model mode compiles
    (its file is ``accounting``'s ``_WRAPPER_FILE``: never named as the function a graph break split)."""

    def forward(*inputs):
        return call(module, *inputs)

    return forward


class WholeModel(_Dynamo):
    """``compile``: the whole forward through one ``torch.compile``."""

    name = "compile"

    def meets_recompile_limit(self, config: Config) -> bool:
        return not config.dynamic

    def build(self, forward: Forward) -> None:
        own = with_private_code(_whole(forward.module, forward.call))
        forward._codes = (own.__code__,)
        forward._compiled = forward.torch_compiled(own)

    def run(self, forward: Forward, inputs: tuple):
        return forward._compiled(*inputs)


# --- compile_regional: each repeated block ----------------------------------------------------------


def recompile_limit() -> int:
    from torch._dynamo import config

    return getattr(config, "recompile_limit", None) or config.cache_size_limit


# A block class meets every shape of the UNet in one call (and every block position, where its options
# must carry it), so it needs many entries where a whole-model compile needs one per input signature.
REGIONAL_RECOMPILE_LIMIT = 64


def _recompile_limit_at_least(limit: int):
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(limit, recompile_limit())})


def repeated_blocks(module: torch.nn.Module, classes: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """Regional compile's blocks: the outermost submodules of a class that ``classes`` names; where it
    names none or none is there, the outermost composite blocks whose class occurs at least twice
    (torch.nn containers excluded)."""
    named = _outermost(module, lambda sub: type(sub).__name__ in classes)
    if named:
        return named
    counts: dict[type, int] = {}
    for sub in module.modules():
        counts[type(sub)] = counts.get(type(sub), 0) + 1
    return _outermost(module, lambda sub: (
        counts[type(sub)] > 1
        and any(True for _ in sub.children())
        and not isinstance(sub, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))
        and not type(sub).__module__.startswith("torch.")
    ))


def _outermost(module: torch.nn.Module, is_block: Callable[[torch.nn.Module], bool]) -> list[torch.nn.Module]:
    chosen = []

    def walk(sub):
        for child in sub.children():
            if is_block(child):
                chosen.append(child)
            else:
                walk(child)

    walk(module)
    return chosen


def _dense(value):
    if not isinstance(value, torch.Tensor) or value.is_contiguous() or (
            value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last)):
        return value
    return value.contiguous()


def _block_argument(block_options: Callable[[dict], dict] | None) -> Callable:
    """How each argument reaches a compiled block: every tensor dense (contiguous, or channels-last as
    stored), since dynamo guards on strides and a block fed straight from a transpose (SD3's first
    joint block) would otherwise compile its kind a second time; every dict through ``block_options``,
    where given."""
    if block_options is None:
        return _dense
    return lambda value: block_options(value) if isinstance(value, dict) else _dense(value)


def _block_call(compiled: Callable, block: torch.nn.Module, handed: Callable, *args, **kwargs):
    """``compiled(block, ...)`` with each argument as ``handed`` makes it (``_block_argument``)."""
    return compiled(block, *map(handed, args), **{name: handed(value) for name, value in kwargs.items()})


@contextlib.contextmanager
def _blocks_compiled(forward: Forward):
    for block, compiled in forward._block_forwards:
        block.forward = functools.partial(_block_call, compiled, block, forward._handed)
    try:
        yield
    finally:
        for block, _ in forward._block_forwards:
            del block.forward


class Regional(_Dynamo):
    """``compile_regional``: each repeated block class through a ``torch.compile`` of its own; the forward
    runs as it is around them."""

    name = "compile_regional"
    compiles_blocks_only = True
    dynamic_unasked = None  # regional blocks meet many shapes in one UNet call: static, each would compile anew

    def block_classes(self, repeated_blocks: tuple[str, ...]) -> tuple[str, ...]:
        return repeated_blocks

    def build(self, forward: Forward) -> None:
        forward.blocks = repeated_blocks(forward.module, forward.config.block_classes)
        forward.stats.regional_blocks = dict(Counter(type(block).__name__ for block in forward.blocks))
        shared: dict[type, Callable] = {}
        for block in forward.blocks:
            if type(block) not in shared:
                own = with_private_code(type(block).forward)
                forward._codes += (own.__code__,)
                shared[type(block)] = forward.torch_compiled(own)
        forward._block_forwards = [(block, shared[type(block)]) for block in forward.blocks]
        forward._handed = _block_argument(forward.config.block_options)

    def run(self, forward: Forward, inputs: tuple):
        with _blocks_compiled(forward), _recompile_limit_at_least(REGIONAL_RECOMPILE_LIMIT):
            return forward.call(forward.module, *inputs)


# --- trace: one per input signature -----------------------------------------------------------------


class _Traceable(torch.nn.Module):
    """``call(module, *inputs)`` with the ``None`` inputs fixed, since a trace takes tensors only."""

    def __init__(self, module: torch.nn.Module, call: Callable, inputs: tuple):
        super().__init__()
        self.module = module
        self.call = call
        self.layout = tuple(t is None for t in inputs)

    def forward(self, *tensors):
        given = iter(tensors)
        return self.call(self.module, *(None if missing else next(given) for missing in self.layout))


def named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _trace_with_weights_as_inputs(traceable: _Traceable, weights: tuple, tensors: tuple):
    """``traceable`` traced as a function of its module's ``weights`` and then its tensors: the
    tracer records each use of a tensor it was given as an input as a use of that input, so the
    weights' reads become inputs, not constants. The function lives in a compilation unit of its
    own, which goes when the trace does: ``torch.jit.trace`` puts a traced function into
    TorchScript's process-wide unit for good (its ``_compilation_unit`` serves modules only)."""
    count = len(weights)

    def with_weights(*weights_then_tensors):
        return traceable(*weights_then_tensors[count:])

    graph, _ = torch._C._create_graph_by_tracing(with_weights, [*weights, *tensors], torch.jit._trace._create_interpreter_name_lookup_fn(),
                                                 True, False)
    return torch._C.CompilationUnit().create_function("sdopt_trace", graph, False)


class Trace(CompileMode):
    """``trace``: a ``torch.jit`` trace per input signature."""

    name = "trace"
    uses_compile_cache = False
    # the chunk sizes ComfyUI's CPU attention derives from free memory would be constants in the trace
    host_attention_cost = "would freeze values it computes at call time (chunk sizes from free memory) into the trace"
    compiles_with_dynamo = False
    setup_note = "traced per resolution; not frozen, since ComfyUI may patch weights in place"

    def settings(self, config: Config) -> str:
        return f"trace{'-freeze' if config.freeze else ''}"

    def unavailable(self, config: Config, device: torch.device) -> Unavailable | None:
        return None

    def uses_inductor(self, config: Config) -> bool:
        return False

    def run(self, forward: Forward, inputs: tuple):
        return self.traced(forward, inputs)(*(t for t in inputs if t is not None))

    def traced(self, forward: Forward, inputs: tuple) -> Callable:
        """The trace of ``inputs``' signature, ready to take the tensor inputs; ``forward.traces`` keeps
        the latest ``max_traces``. Unfrozen, the trace takes the module's weights as inputs too, so new
        weights need no rebinding; it is a function in a compilation unit of its own, which goes with
        it (a traced module's types, or a function traced by ``torch.jit.trace``, stay in TorchScript's
        process-wide unit for good: some 40 MiB per traced UNet)."""
        config, stats, traces = forward.config, forward.stats, forward.traces
        signature = input_signature(inputs)
        state = named_state(forward.module)
        ready = (lambda traced: traced) if config.freeze else (lambda traced: functools.partial(traced, *state.values()))
        if signature in traces:
            traced, bound = traces[signature]
            traces.move_to_end(signature)
            same_names = state.keys() == bound.keys()
            if same_names and all(bound[name] is value for name, value in state.items()):
                return ready(traced)
            if same_names and not config.freeze:
                traces[signature] = (traced, state)
                stats.weight_rebinds += 1
                return ready(traced)
            stats.recompile_reasons.append("weights changed and a frozen trace holds them as constants" if config.freeze
                                           else "the module's weights are named otherwise than when it was traced")
        started = time.perf_counter()
        traceable = _Traceable(forward.module, forward.call, inputs)
        tensors = tuple(t for t in inputs if t is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if config.freeze:
                traced = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.trace(traceable, tensors, check_trace=False).eval()))
            else:
                traced = _trace_with_weights_as_inputs(traceable, tuple(state.values()), tensors)
        stats.compilations += 1
        stats.compile_seconds += time.perf_counter() - started
        traces[signature] = (traced, state)
        while len(traces) > config.max_traces:
            traces.popitem(last=False)
        return ready(traced)


WHOLE, REGIONAL, TRACE = WholeModel(), Regional(), Trace()
MODE_OBJECTS: dict[str, CompileMode] = {mode.name: mode for mode in (WHOLE, REGIONAL, TRACE)}
MODES = tuple(MODE_OBJECTS)
