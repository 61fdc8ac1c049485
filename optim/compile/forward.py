"""The three modes, each a ``CompiledForward`` equal to ``call(module, *tensors)``.

The caller passes tensors only, so per-step Python values (step count, sigmas, CFG scale) never
reach a guard: a new input signature compiles once, and every other change runs the cached code.
Weights stay inputs in every mode:

- ``compile``: dynamo lifts parameters to graph inputs, so replaced weights are read, not baked in;
- ``compile_regional``: each block class is compiled once and shared by its instances (their
  ``forward`` is bound to the compiled one only while the call runs). The blocks are those of the
  classes ``block_classes`` names (the model family's repeated blocks), a class that occurs once
  included; with none named or found, every composite class that occurs at least twice. Dynamo keeps
  weight shapes static, so instances of one class whose weights differ in shape compile apart; what
  a block is handed besides tensors goes through ``block_options`` first, where a host leaves out what
  differs per block (ComfyUI's block position), so that alike blocks share one compiled entry;
- ``trace``: one trace per input signature, taking the weights as inputs, so replaced weights need
  no new trace; with ``freeze`` (weights folded in as constants) the trace is redone, which the
  stats say.

The first call of each input signature runs eagerly, so lazy set-up in the module stays out of the
compiled code. Each ``CompiledForward`` compiles a private copy of its function's code: dynamo keeps
compiled entries, its recompile limit and its guard failures per code object, and every model's
UNet call shares one function; where torch has ``isolate_recompiles``, the functions a graph break
leaves outside that code keep their entries per compiled model too. Past that limit a new input
signature runs eagerly, and the stats say so. On a CPU each compiled signature is timed against
eager and runs eagerly where compiled was slower. ``graph_break_reasons`` tells beforehand whether
a function traces as one graph.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import time
import types
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cuda_graph import input_signature
from .accounting import CompileStats, accounted, note_reuse, regions_run
from .config import CompileConfig
from .private_code import release_compiled_code, with_private_code

def isolated_recompiles() -> dict:
    """torch.compile's ``isolate_recompiles`` where this torch has it: the functions a graph break
    leaves outside the compiled model then keep entries (and a recompile limit) per compiled model,
    not one set shared by every compiled model in the process."""
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def graph_break_reasons(fn: Callable, *args, **kwargs) -> list[str]:
    """Why torch.compile cannot trace ``fn(*args, **kwargs)`` as one graph: the reasons of its graph
    breaks and of the functions it gave up on; [] where it traces whole. Traced with the eager
    backend over a private copy of ``fn``'s code, in its own recompile region where torch has them."""
    stats = CompileStats(owner="sdopt's graph-break probe")
    probe = torch.compile(with_private_code(fn), backend="eager", dynamic=False, **isolated_recompiles())
    with accounted(stats):
        probe(*args, **kwargs)
    return [*stats.graph_breaks, *dict.fromkeys(g.reason for g in stats.gave_up.values())]


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


_compiled_models = itertools.count(1)
# On a CPU compiled code can be slower than eager (small inputs, weight layout copies per call): each
# input signature, once compiled, is timed eagerly once and compiled TRIAL_CALLS times, and runs
# eagerly from then on where compiled ran below SLOWER_THAN_EAGER of the eager speed.
TRIAL_CALLS = 2  # 0: no trials
SLOWER_THAN_EAGER = 0.95
MIN_TRIAL_SECONDS = 0.01  # a shorter eager call is left compiled: too short to time apart from noise


@dataclass
class SpeedTrial:
    """One input signature timed eagerly once, then compiled ``TRIAL_CALLS`` times (seconds)."""

    eager_seconds: float | None = None
    compiled_seconds: list[float] = field(default_factory=list)

    def add(self, eager: bool, seconds: float) -> None:
        if eager:
            self.eager_seconds = seconds
        else:
            self.compiled_seconds.append(seconds)

    @property
    def decided(self) -> bool:
        return len(self.compiled_seconds) >= TRIAL_CALLS or (self.eager_seconds is not None and self.eager_seconds < MIN_TRIAL_SECONDS)

    @property
    def speedup(self) -> float:
        """Compiled speed over eager speed, from the fastest compiled call."""
        return self.eager_seconds / min(self.compiled_seconds)

    @property
    def compiled_slower(self) -> bool:
        return bool(self.compiled_seconds) and self.speedup < SLOWER_THAN_EAGER


def on_cpu(inputs: tuple) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in inputs)



class CompiledForward:
    """``call(module, *inputs)`` through the compiled artifact of ``config.mode``."""

    def __init__(self, module: torch.nn.Module, call: Callable, config: CompileConfig):
        self.module = module
        self.call = call
        self.config = config
        self.stats = CompileStats(owner=f"sdopt compiled model #{next(_compiled_models)} ({config.settings()}, {time.strftime('%H:%M:%S')})",
                                  isolated=bool(isolated_recompiles()))
        self.seen: set = set()
        # signatures whose first compiled call was watched for graphs another compile made: only
        # where torch shares what a graph break leaves outside between compiled models
        self._watched: set = set()
        self._trials: dict[tuple, SpeedTrial] = {}  # CPU signatures compiled and not yet timed against eager
        self.traces: OrderedDict[tuple, tuple[Callable, dict]] = OrderedDict()
        self._codes: tuple[types.CodeType, ...] = ()
        if config.mode == "compile":

            def forward(*inputs):
                return call(module, *inputs)

            own = with_private_code(forward)
            self._codes = (own.__code__,)
            self._compiled = torch.compile(own, **config.torch_compile_kwargs(), **isolated_recompiles())
        elif config.mode == "compile_regional":
            self.blocks = repeated_blocks(module, config.block_classes)
            self.stats.regional_blocks = dict(Counter(type(block).__name__ for block in self.blocks))
            shared: dict[type, Callable] = {}
            for block in self.blocks:
                if type(block) not in shared:
                    own = with_private_code(type(block).forward)
                    self._codes += (own.__code__,)
                    shared[type(block)] = torch.compile(own, **config.torch_compile_kwargs(), **isolated_recompiles())
            self._block_forwards = [(block, shared[type(block)]) for block in self.blocks]
            self._handed = _block_argument(config.block_options)
        if self._codes:
            weakref.finalize(self, release_compiled_code, self._codes).atexit = False  # an exiting process frees it all

    def __call__(self, *inputs):
        signature = input_signature(inputs)
        if signature not in self.seen:
            # Lazy Python-side set-up in the module (per-shape attention decisions, records, caches)
            # runs eagerly once, so the compiled code only meets its steady path and needs no graph break;
            # only a call that finished counts (an interrupted one may have left the set-up half done).
            out = self.call(self.module, *inputs)
            self.seen.add(signature)
            return out
        if self._past_recompile_limit(signature) or signature in self.stats.slower_than_eager:
            return self.call(self.module, *inputs)
        trial = self._trials.get(signature)
        if trial is not None:
            return self._timed(signature, trial, inputs)
        compilations, ran = self.stats.compilations, set()
        watch = self.config.mode != "trace" and not self.stats.isolated and signature not in self._watched
        self._watched.add(signature)
        try:
            with regions_run(ran) if watch else contextlib.nullcontext():
                return self._run(inputs)
        finally:
            if self.stats.compilations > compilations:
                self.stats.signatures.add(signature)
                if TRIAL_CALLS and on_cpu(inputs):
                    self._trials[signature] = SpeedTrial()
            note_reuse(self.stats, ran)

    def _timed(self, signature, trial: SpeedTrial, inputs: tuple):
        """One call of a signature on trial: its eager reference first, then compiled ones; once
        decided, the signature runs compiled, or eagerly where compiled measured slower."""
        eager = trial.eager_seconds is None
        started = time.perf_counter()
        output = self.call(self.module, *inputs) if eager else self._run(inputs)
        trial.add(eager, time.perf_counter() - started)
        if trial.decided:
            del self._trials[signature]
            if trial.compiled_slower:
                self.stats.slower_than_eager[signature] = trial
        return output

    def _past_recompile_limit(self, signature) -> bool:
        """Whether a new signature must run eagerly because dynamo's limit would turn it away anyway."""
        if self.config.mode != "compile" or self.config.dynamic or signature in self.stats.signatures:
            return False
        self.stats.recompile_limit = recompile_limit()
        if len(self.stats.signatures) < self.stats.recompile_limit:
            return False
        self.stats.eager_signatures.add(signature)
        return True

    def _run(self, inputs: tuple):
        with accounted(self.stats, self._codes):
            if self.config.mode == "compile":
                return self._compiled(*inputs)
            if self.config.mode == "compile_regional":
                with self._blocks_compiled(), _recompile_limit_at_least(REGIONAL_RECOMPILE_LIMIT):
                    return self.call(self.module, *inputs)
            return self._traced(inputs)(*(t for t in inputs if t is not None))

    @contextlib.contextmanager
    def _blocks_compiled(self):
        for block, compiled in self._block_forwards:
            block.forward = functools.partial(_block_call, compiled, block, self._handed)
        try:
            yield
        finally:
            for block, _ in self._block_forwards:
                del block.forward

    def _traced(self, inputs: tuple) -> Callable:
        """The trace of ``inputs``' signature, ready to take the tensor inputs. Unfrozen, the trace
        takes the module's weights as inputs too, so new weights need no rebinding; it is a function
        in a compilation unit of its own, which goes with it (a traced module's types, or a function
        traced by ``torch.jit.trace``, stay in TorchScript's process-wide unit for good: some 40 MiB
        per traced UNet)."""
        signature = input_signature(inputs)
        state = named_state(self.module)
        ready = (lambda traced: traced) if self.config.freeze else (lambda traced: functools.partial(traced, *state.values()))
        if signature in self.traces:
            traced, bound = self.traces[signature]
            self.traces.move_to_end(signature)
            same_names = state.keys() == bound.keys()
            if same_names and all(bound[name] is value for name, value in state.items()):
                return ready(traced)
            if same_names and not self.config.freeze:
                self.traces[signature] = (traced, state)
                self.stats.weight_rebinds += 1
                return ready(traced)
            self.stats.recompile_reasons.append("weights changed and a frozen trace holds them as constants" if self.config.freeze
                                                else "the module's weights are named otherwise than when it was traced")
        started = time.perf_counter()
        traceable = _Traceable(self.module, self.call, inputs)
        tensors = tuple(t for t in inputs if t is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if self.config.freeze:
                traced = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.trace(traceable, tensors, check_trace=False).eval()))
            else:
                traced = _trace_with_weights_as_inputs(traceable, tuple(state.values()), tensors)
        self.stats.compilations += 1
        self.stats.compile_seconds += time.perf_counter() - started
        self.traces[signature] = (traced, state)
        while len(self.traces) > self.config.max_traces:
            self.traces.popitem(last=False)
        return ready(traced)


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


def compile_forward(module: torch.nn.Module, call: Callable, config: CompileConfig = CompileConfig()) -> CompiledForward:
    return CompiledForward(module, call, config)
