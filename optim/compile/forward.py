"""``CompiledForward``: ``call(module, *tensors)`` through the compiled artifact of its config's mode
(``modes``: whole-model compile, per-block compile, per-signature trace).

The caller passes tensors only, so per-step Python values (step count, sigmas, CFG scale) never
reach a guard: a new input signature compiles once, and every other change runs the cached code.

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
import inspect
import itertools
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cuda_graph import input_signature
from .accounting import CompileStats, accounted, note_reuse, regions_run
from .config import CompileConfig
from .modes import recompile_limit
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
    """``call(module, *inputs)`` through the compiled artifact of ``config.mode``: what its mode object
    (``config.kind``) sets up and runs, the set-up held here (``_compiled``, ``blocks``, ``traces``)."""

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
        config.kind.build(self)
        if self._codes:
            weakref.finalize(self, release_compiled_code, self._codes).atexit = False  # an exiting process frees it all

    def torch_compiled(self, fn: Callable) -> Callable:
        """``fn`` through torch.compile with this forward's settings, in a recompile region of its own
        where torch has them (``fn`` is a private code copy: ``with_private_code``)."""
        return torch.compile(fn, **self.config.torch_compile_kwargs(), **isolated_recompiles())

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
        watch = self.config.kind.compiles_with_dynamo and not self.stats.isolated and signature not in self._watched
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
        if not self.config.kind.meets_recompile_limit(self.config) or signature in self.stats.signatures:
            return False
        self.stats.recompile_limit = recompile_limit()
        if len(self.stats.signatures) < self.stats.recompile_limit:
            return False
        self.stats.eager_signatures.add(signature)
        return True

    def _run(self, inputs: tuple):
        with accounted(self.stats, self._codes):
            return self.config.kind.run(self, inputs)


def compile_forward(module: torch.nn.Module, call: Callable, config: CompileConfig = CompileConfig()) -> CompiledForward:
    return CompiledForward(module, call, config)
