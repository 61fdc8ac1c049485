"""Compiled forwards: ``torch.compile`` whole or by repeated block, or ``torch.jit.trace``.

``compile_forward(module, call, CompileConfig(...))`` returns a ``CompiledForward`` whose
``__call__(*tensors)`` equals ``call(module, *tensors)``. The caller passes tensors only, so per-step
Python values (step count, sigmas, CFG scale) never reach a guard: a new input signature compiles
once, and every other change runs the cached code. Weights stay inputs in every mode:

- ``compile``: dynamo lifts parameters to graph inputs, so replaced weights are read, not baked in;
- ``compile_regional``: each block class is compiled once and shared by its instances (their
  ``forward`` is bound to the compiled one only while the call runs). The blocks are those of the
  classes ``block_classes`` names (the model family's repeated blocks), a class that occurs once
  included; with none named or found, every composite class that occurs at least twice. Instances
  differ in shape and in the per-block numbers ComfyUI passes along, so unless ``dynamic`` is set
  those become dynamic on the first difference (torch's automatic dynamic), not one compile each;
- ``trace``: one trace per input signature, taking the weights as inputs, so replaced weights need
  no new trace; with ``freeze`` (weights folded in as constants) the trace is redone, which the
  stats say.

The first call of each input signature runs eagerly, so lazy set-up in the module stays out of the
compiled code. Each ``CompiledForward`` compiles a private copy of its function's code: dynamo keeps
compiled entries, its recompile limit and its guard failures per code object, and every model's
UNet call shares one function; where torch has ``isolate_recompiles``, the functions a graph break
leaves outside that code keep their entries per compiled model too. Past that limit a new input
signature runs eagerly, and the stats say so. ``stats`` counts compilations with their time and the
forward's own guard-failure reasons, and says what torch did short of one graph, from its own
compilation metrics and recompile-limit warning: where it broke the graph and why, the functions it
gave up on (they run eagerly), and, where torch shares those outside functions' entries between
compiled models, the graphs this model ran that another compile made (seen by torch's profiler in
the first compiled call of each input signature). ``graph_break_reasons`` tells beforehand whether
a function traces as one graph.
``ArtifactCache`` is a folder per architecture, torch version and settings: while sdopt's compiled
code runs, torch's own compiler caches (inductor's graphs and kernels, Triton's) are read and written
there, beside torch's portable artifacts (``torch.compiler.save_cache_artifacts``), so a new process
compiles warm and deleting the folder makes the next compile cold. Only folders it marked as its own
are listed or purged.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import inspect
import itertools
import json
import linecache
import logging
import os
import re
import shutil
import time
import types
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import Unavailable
from .cuda_graph import input_signature

MODES = ("compile", "compile_regional", "trace")
BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ARTIFACTS = "artifacts.bin"
META = "meta.json"


@dataclass(frozen=True)
class CompileConfig:
    mode: str = "compile"
    backend: str = "inductor"
    compile_mode: str = "default"
    dynamic: bool = False
    fullgraph: bool = False
    freeze: bool = False
    max_traces: int = 4
    block_classes: tuple[str, ...] = ()  # compile_regional's blocks, by class name (the model family's repeated blocks)

    def __post_init__(self):
        for name, value, allowed in (("mode", self.mode, MODES), ("backend", self.backend, BACKENDS), ("compile_mode", self.compile_mode, COMPILE_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")

    def torch_compile_kwargs(self) -> dict:
        return {
            "backend": self.backend,
            "mode": None if self.compile_mode == "default" or self.backend != "inductor" else self.compile_mode,
            # regional blocks meet many shapes in one UNet call: static, each would compile anew
            "dynamic": True if self.dynamic else (None if self.mode == "compile_regional" else False),
            "fullgraph": self.fullgraph,
        }

    def settings(self) -> str:
        if self.mode == "trace":
            return f"trace{'-freeze' if self.freeze else ''}"
        return f"{self.mode}-{self.backend}-{self.compile_mode}{'-dynamic' if self.dynamic else ''}{'-fullgraph' if self.fullgraph else ''}"


def unavailable(config: CompileConfig, device: torch.device) -> Unavailable | None:
    """Why ``config`` cannot run on ``device`` here and the fix that fits, or None when it can."""
    if config.mode == "trace":
        return None
    other_backend = "pick backend aot_eager or eager, or mode trace"
    if config.backend == "inductor":
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return Unavailable("inductor on CUDA needs Triton (pip install triton)", f"install triton, or {other_backend}", "backend")
        if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return Unavailable("inductor on a CPU needs a C++ compiler (g++ or clang++)", f"install g++ or clang++, or {other_backend}", "backend")
    if config.backend == "cudagraphs" and device.type != "cuda":
        return Unavailable(f"the cudagraphs backend needs a CUDA device; this model runs on {device.type}",
                           "pick backend inductor, aot_eager or eager, or mode trace", "backend")
    return None


def nchw_conv_weight_bytes(module: torch.nn.Module, config: CompileConfig) -> int:
    """Bytes of 2-D conv weights that inductor copies to channels-last on every call: it lays such
    convolutions out channels-last (its layout optimization) and the weights are graph inputs, so
    weights stored NCHW are converted each time. Stored channels-last, they are used as they are."""
    if config.mode == "trace" or config.backend != "inductor":
        return 0
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    return sum(w.numel() * w.element_size() for w in weights if not w.is_contiguous(memory_format=torch.channels_last))


# --- compile accounting: dynamo's callbacks, attributed to the forward that is running ----------


@dataclass(frozen=True)
class GaveUp:
    """A function torch would not compile, so that it runs eagerly: which, why, and the fix."""

    function: str
    reason: str
    fix: str


GRAPH_BREAK_FIX = (
    "keep that call out of the model's forward (for ComfyUI's attention: an sdopt Attention node); "
    "fullgraph=on stops at the first break with torch's full message"
)
EAGER_FRAME_FIX = "torch runs the whole function eagerly and compiles what it calls apart; " + GRAPH_BREAK_FIX
RECOMPILE_LIMIT_FIX = "raise torch._dynamo.config.recompile_limit, or compile with dynamic; a graph break above multiplies recompiles"


CPU_PROBE_NOTE_SECONDS = 0.5  # a shorter probe read its answer from the cache folder: not worth a word


@dataclass
class CompileStats:
    compilations: int = 0
    compile_seconds: float = 0.0
    recompile_reasons: list[str] = field(default_factory=list)
    weight_rebinds: int = 0
    signatures: set = field(default_factory=set)
    eager_signatures: set = field(default_factory=set)  # past dynamo's recompile limit
    recompile_limit: int = 0
    owner: str = ""  # which compiled model this is, as the record of another one names it
    graph_breaks: dict[str, list[str]] = field(default_factory=dict)  # torch's reason → the functions it split
    gave_up: dict[str, GaveUp] = field(default_factory=dict)  # by function: those torch runs eagerly
    reused: dict[str, int] = field(default_factory=dict)  # who compiled them → graphs this model ran but did not compile
    isolated: bool = False  # torch keeps the entries of what a graph break leaves outside per compiled model
    slower_than_eager: dict = field(default_factory=dict)  # signature → its SpeedTrial: these run eagerly
    cpu_probed: bool = False
    cpu_probe_seconds: float = 0.0  # torch's CPU vector-ISA probe, outside compile_seconds
    regional_blocks: dict[str, int] | None = None  # compile_regional: instances per compiled block class

    @property
    def cache_entries(self) -> int:
        """Input signatures that needed compiling: a new resolution adds one, anything else none."""
        return len(self.signatures)

    def summary(self) -> str:
        text = f"{self.cache_entries} input signature(s), {self.compilations} compilation(s) in {self.compile_seconds:.1f} s"
        if self.regional_blocks:
            text += ", by block: " + ", ".join(f"{count} {name}" for name, count in self.regional_blocks.items())
        if self.cpu_probe_seconds >= CPU_PROBE_NOTE_SECONDS:
            text += (f", after torch's one-time probe of this CPU's vector instructions ({self.cpu_probe_seconds:.1f} s, "
                     "kept in torch's own cache folder for later processes)")
        if self.recompile_reasons:
            text += "; recompiled because: " + " | ".join(dict.fromkeys(self.recompile_reasons))
        if self.weight_rebinds:
            text += f"; new weights bound {self.weight_rebinds} time(s) without recompiling"
        if self.eager_signatures:
            text += (f"; {len(self.eager_signatures)} more input signature(s) ran eagerly: torch's recompile limit "
                     f"({self.recompile_limit} per compiled model) was reached (raise torch._dynamo.config.recompile_limit, "
                     "or compile with dynamic)")
        return text

    def details(self) -> list[str]:
        """What torch did short of one graph per input signature, each with its fix; and the graphs
        this model ran that another compile made."""
        lines = [f"reused {n} graph(s) compiled earlier in this process by {owner}" for owner, n in self.reused.items()]
        for trial in self.slower_than_eager.values():
            lines.append(f"turned itself off for one input signature: compiled {min(trial.compiled_seconds) * 1e3:,.0f} ms a call "
                         f"against {trial.eager_seconds * 1e3:,.0f} ms eager ({trial.speedup:.2f}x), so it runs eagerly; "
                         "fix: sdopt Precision's channels_last (conv weights stored as inductor lays them out), or a larger image")
        for reason, functions in self.graph_breaks.items():
            pieces = "its own (torch's isolate_recompiles)" if self.isolated else "shared with every compiled model in this process"
            lines.append(f"graph break ({reason}) in {_some(functions)}: those parts run as separate graphs, {pieces}; "
                         f"fix: {GRAPH_BREAK_FIX}")
        by_cause: dict[tuple[str, str], list[str]] = {}
        for gave_up in self.gave_up.values():
            by_cause.setdefault((gave_up.reason, gave_up.fix), []).append(gave_up.function)
        for (reason, fix), functions in by_cause.items():
            lines.append(f"torch gave up on {_some(functions)} ({reason}): they run eagerly; fix: {fix}")
        return lines

    def shortfall(self) -> str:
        """One line where this model ran less compiled than asked; "" where it ran as asked."""
        parts = []
        if self.gave_up:
            parts.append(f"{len(self.gave_up)} function(s) ran eagerly ({_some(list(self.gave_up), 2)})")
        broken = [name for functions in self.graph_breaks.values() for name in functions]
        if self.graph_breaks:
            parts.append(f"graph broken in {len(broken)} function(s)" + (f" ({_some(broken, 2)})" if broken else ""))
        if self.eager_signatures:
            parts.append(f"{len(self.eager_signatures)} input signature(s) eager past the recompile limit")
        if self.slower_than_eager:
            parts.append(f"off for {len(self.slower_than_eager)} input signature(s): compiled ran slower than eager")
        if self.regional_blocks == {}:
            parts.append("no block to compile one by one: the model ran eagerly (use mode compile)")
        return ", ".join(parts)


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


_running: list[CompileStats] = []
_started: dict = {}


def _compile_id(args: tuple):
    return getattr(args[0], "compile_id", None) if args else None


def _on_compile_start(*args, **_kwargs):
    if _running:
        _harvest_metrics(_running[-1])  # the frames compiled before this one: torch keeps only the last 64
        _running[-1].compilations += 1
        _started[_compile_id(args)] = (_running[-1], time.perf_counter())
        _owners[str(_compile_id(args))] = _running[-1].owner


def _on_compile_end(*args, **_kwargs):
    stats, started = _started.pop(_compile_id(args), (None, 0.0))
    if stats is not None:
        stats.compile_seconds += time.perf_counter() - started


def _install_callbacks() -> None:
    from torch._dynamo import callback_handler

    if _on_compile_start not in callback_handler.start_callbacks:  # torch._dynamo.reset() clears them
        _owners.clear()  # and compile ids start again
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)


def _guard_failures(codes: tuple[types.CodeType, ...]) -> list[str]:
    from torch._dynamo.utils import guard_failures

    return [str(reason) for code in codes for reason in guard_failures.get(code, ())]


def _reason_line(reason: str) -> str:
    """The first sentence of a guard failure: dynamo appends the user's stack trace below it."""
    return reason.strip().splitlines()[0].split(". ")[0]


# --- what torch gave up on: its compilation metrics and its recompile-limit warning ----------------

_owners: dict[str, str] = {}  # compile id → the owner of the stats its compile was attributed to
_last_metric: list = [None]  # the newest of torch's compilation metrics already read
_RESUME_NAME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")
_PRIVATE_NAME = re.compile(r"__sdopt\d+$")
_RECOMPILE_LIMIT = re.compile(r"hit config\.(?P<limit_type>\w+) \((?P<limit>\d+)\)\s*function: '(?P<function>[^']*)' \((?P<where>[^)]*)\)"
                              r"(?:\s*last reason: (?P<last>[^\n]*))?")


def function_name(co_name: str, filename: str | None = None, line: int | None = None) -> str:
    """A compiled frame's function as a reader knows it: a resume function named after the function
    it resumes, sdopt's private code copies after their original, with file and first line."""
    resumed = _RESUME_NAME.match(co_name)
    name = _PRIVATE_NAME.sub("", resumed.group("name") if resumed else co_name)
    return f"{name} ({os.path.basename(filename)}:{line})" if filename else name


def reason_text(reason: str) -> str:
    """torch's reason in one line: its headline, and the first sentence of its explanation."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), "")
    explanation = explanation.split(". ")[0]
    return f"{lines[0]}: {explanation}" if explanation else lines[0]


def _compilation_metrics() -> list:
    from torch._dynamo import utils

    read = getattr(utils, "get_compilation_metrics", None)
    return read() if read else []


def _harvest_metrics(stats: CompileStats | None) -> None:
    """File the frames compiled since the last harvest into ``stats`` (None: skip them): graph
    breaks by reason, and the functions torch gave up on. Recompile-limit failures name no
    function here; their warning does (``_RecompileLimitWarnings``)."""
    metrics = _compilation_metrics()
    start = next((i + 1 for i in range(len(metrics) - 1, -1, -1) if metrics[i] is _last_metric[0]), 0)
    _last_metric[0] = metrics[-1] if metrics else None
    for metric in metrics[start:] if stats is not None else ():
        note_metric(stats, metric)


def note_metric(stats: CompileStats, metric) -> None:
    """File one of torch's ``CompilationMetrics`` into ``stats``."""
    name = function_name(metric.co_name, metric.co_filename, metric.co_firstlineno) if metric.co_name else None
    ours = metric.co_filename == __file__  # the compiled forward's own wrapper: split because what it calls is
    for reason in sorted(metric.restart_reasons or ()):
        functions = stats.graph_breaks.setdefault(reason_text(reason), [])
        if name and not ours and name not in functions:
            functions.insert(0, name)  # inner frames compile after the outer ones: the untraceable call comes first
    failure = metric.fail_reason or ""
    if metric.fail_type and name and "recompile limit" not in failure.lower():
        stats.gave_up[name] = GaveUp(name, reason_text(failure or metric.fail_type), EAGER_FRAME_FIX)


class _RecompileLimitWarnings(logging.Handler):
    """Files torch's "hit config.recompile_limit" warning, the one place that names the function."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        if not _running:
            return
        try:
            found = _RECOMPILE_LIMIT.search(record.getMessage())
        except Exception:  # a record whose arguments do not fit its message: not ours to read
            return
        if found:
            name = function_name(found["function"], found["where"].rpartition(":")[0], found["where"].rpartition(":")[2])
            last = f"; last recompile because {found['last'].split(': ', 1)[-1]}" if found["last"] else ""
            reason = f"hit torch's {found['limit_type']} ({found['limit']}){last}"
            _running[-1].gave_up[name] = GaveUp(name, reason, RECOMPILE_LIMIT_FIX)


_limit_warnings = _RecompileLimitWarnings()


@contextlib.contextmanager
def accounted(stats: CompileStats, codes: tuple[types.CodeType, ...] = ()):
    """Attribute the compilations that happen inside to ``stats``, the guard failures of ``codes``
    (the compiled code objects) to its recompile reasons, and what torch gave up on to its
    graph breaks and eager functions."""
    sweep_dead_guards()
    _install_callbacks()
    before = len(_guard_failures(codes))
    _harvest_metrics(None)
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(_limit_warnings)
    _running.append(stats)
    try:
        yield
    finally:
        _harvest_metrics(stats)
        _running.pop()
        if not _running:
            dynamo_log.removeHandler(_limit_warnings)
        stats.recompile_reasons.extend(_reason_line(r) for r in _guard_failures(codes)[before:])


# --- graphs this model ran that another compile made ----------------------------------------------

REGION_PREFIX = "Torch-Compiled Region: "


@contextlib.contextmanager
def regions_run(found: set[str]):
    """Collect into ``found`` the compile ids of the compiled regions run inside (torch's profiler
    names each ``Torch-Compiled Region: <id>``); nothing where a profiler runs already or a CUDA
    graph is being captured."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if torch.autograd.profiler._is_profiler_enabled or capturing:
        yield
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        yield
    results = getattr(profiled.profiler, "kineto_results", None)
    names = [event.name() for event in results.events()] if results is not None else [event.name for event in profiled.events()]
    found.update(name[len(REGION_PREFIX):] for name in names if name.startswith(REGION_PREFIX))


def note_reuse(stats: CompileStats, ran: set[str]) -> None:
    """File the regions ``stats``' model ran that it did not compile itself, by who compiled them."""
    for compile_id in sorted(ran):
        owner = _owners.get(compile_id, "a torch.compile outside sdopt")
        if owner != stats.owner:
            stats.reused[owner] = stats.reused.get(owner, 0) + 1


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


_private_code_ids = itertools.count(1)


def with_private_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` over a private copy of its code object, renamed so that it is neither the same object
    nor equal to the original, which dynamo's per-code bookkeeping (compiled entries, recompile
    limit, guard failures) would otherwise share. (A ``functools.partial`` would not do: torch
    compiles it through one wrapper function of its own, shared by every partial in the process.)"""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__sdopt{next(_private_code_ids)}")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


_released = False  # whether a compiled model went since the last sweep of its guards' finalizers


def release_compiled_code(codes: tuple[types.CodeType, ...]) -> None:
    """Drop what dynamo keeps for ``codes`` (private code objects of a compiled model that is gone):
    their compiled entries, and with them the graphs and the globals dynamo installed for them.
    The entries live in the code objects' extra state, which the garbage collector does not see,
    and they hold the code objects alive in turn, so without this every compiled model's graphs
    stay in the process for good. Their guards go at the next ``sweep_dead_guards``: this may run
    inside any allocation, even in the middle of a compile."""
    global _released
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo.utils import guard_failures

    for code in codes:
        reset_code(code)
        guard_failures.pop(code, None)
    _released = True


def sweep_dead_guards() -> None:
    """Detach the finalizers that keep the guards of dropped compiled entries alive, and free what
    torch keeps of finished compiles (``_free_finished_compile_state``). Dynamo puts a
    ``weakref.finalize`` on every object a guard matches by identity (classes, modules, functions
    that live as long as the process) to invalidate the guard's entry should the object go; once
    the entry is gone the callback does nothing but hold the guards (some 15 MiB per compiled UNet).
    Only between compiles (under dynamo's compile lock, never inside a compiled call), where no
    guard is half built; nothing on a torch whose guards are kept otherwise."""
    global _released
    if not _released or _running:
        return
    try:
        from torch._dynamo.convert_frame import compile_lock
        from torch._dynamo.guards import CheckFunctionManager
    except ImportError:
        return
    with compile_lock:
        _released = False
        for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
            manager = getattr(getattr(getattr(info, "func", None), "func", None), "__self__", None)  # partial(manager.invalidate, …)
            if type(manager) is CheckFunctionManager and getattr(manager.guard_manager, "cache_entry", True) is None:
                finalizer.detach()
        _free_finished_compile_state()


def _free_finished_compile_state() -> None:
    """Free what torch keeps of finished compiles for the life of the process.

    - A dynamic-shape compile leaves its ``ShapeEnv`` in a cycle the garbage collector cannot see
      through: its ``tracked_fakes`` hold fake tensors whose symbolic sizes (C++ objects) hold the
      ``ShapeEnv`` again; and ``ShapeEnv``'s memoized methods keep every instance they saw as a key.
      Regional compile, dynamic by default, left 29 of them with their graphs for every SDXL model a
      server compiled. ``tracked_fakes`` serve only to build a compile's guards, and no compile runs
      while dynamo's compile lock is held, so both go.
    - torch.fx keeps the generated source of every graph module it ever made, for tracebacks, under
      the file name its code was compiled with (some 4 MiB per whole-model compile of the SDXL mini);
      the source of graphs no live function or frame runs goes."""
    from torch.fx import graph_module
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    live_files = set()
    for candidate in gc.get_objects():
        if type(candidate) is ShapeEnv and getattr(candidate, "tracked_fakes", None) is not None:
            candidate.tracked_fakes = None
        elif type(candidate) is types.FunctionType:
            live_files.add(candidate.__code__.co_filename)
        elif type(candidate) is types.FrameType:
            live_files.add(candidate.f_code.co_filename)
    for member in vars(ShapeEnv).values():
        if hasattr(member, "cache_clear"):
            member.cache_clear()
    sources = getattr(getattr(graph_module, "_loader", None), "eval_cache", None)
    if isinstance(sources, dict):
        for name in [name for name in sources if name not in live_files]:
            sources.pop(name, None)
            linecache.cache.pop(name, None)


def recompile_limit() -> int:
    from torch._dynamo import config

    return getattr(config, "recompile_limit", None) or config.cache_size_limit


# A block class meets every shape and block position of the UNet in one call, so it needs many
# entries where a whole-model compile needs one per input signature.
REGIONAL_RECOMPILE_LIMIT = 64


def _recompile_limit_at_least(limit: int):
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(limit, recompile_limit())})


# --- the three modes ----------------------------------------------------------------------------


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


def _named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
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


def _on_cpu(inputs: tuple) -> bool:
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
        if self._codes:
            weakref.finalize(self, release_compiled_code, self._codes).atexit = False  # an exiting process frees it all

    def __call__(self, *inputs):
        signature = input_signature(inputs)
        if signature not in self.seen:
            # Lazy Python-side set-up in the module (per-shape attention decisions, records, caches)
            # runs eagerly once, so the compiled code only meets its steady path and needs no graph break.
            self.seen.add(signature)
            return self.call(self.module, *inputs)
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
                if TRIAL_CALLS and _on_cpu(inputs):
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
            block.forward = functools.partial(_on_dense_inputs, compiled, block)
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
        state = _named_state(self.module)
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


def _on_dense_inputs(compiled: Callable, block: torch.nn.Module, *args, **kwargs):
    """``compiled(block, ...)`` with every tensor argument dense (contiguous, or channels-last as
    stored): dynamo guards on strides, and a block fed straight from a transpose (SD3's first joint
    block) would otherwise compile its kind a second time."""
    return compiled(block, *map(_dense, args), **{name: _dense(value) for name, value in kwargs.items()})


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


# --- persistent artifacts -----------------------------------------------------------------------


def default_cache_dir() -> Path:
    if os.environ.get("SDOPT_CACHE_DIR"):
        return Path(os.environ["SDOPT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdopt" / "compile"


def architecture_hash(module: torch.nn.Module) -> str:
    """A hash of the module's class and tensor names, shapes, strides and dtypes: compiled code
    depends on these (the strides say which weights are channels-last), not on the weight values,
    which stay inputs."""
    digest = hashlib.sha256(type(module).__qualname__.encode())
    for name, tensor in _named_state(module).items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.stride()}:{tensor.dtype}".encode())
    return digest.hexdigest()[:16]


WRITTEN_BY = "sdopt compile cache"  # meta.json's mark: only folders that carry it are listed and purged
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_VAR = "TRITON_CACHE_DIR"


def _timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _torch_default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    return os.path.abspath(torch_default())


def users_cache_dirs() -> dict[str, str]:
    """The torch cache variables the user set, which sdopt leaves as they are. torch sets them too,
    to its defaults, on first use: ``TORCHINDUCTOR_CACHE_DIR`` to /tmp/torchinductor_<user> and
    ``TRITON_CACHE_DIR`` to <that>/triton/<device>; those values are not the user's."""
    default = _torch_default_cache_dir()
    chosen = {}
    inductor = os.environ.get(INDUCTOR_CACHE_VAR)
    if inductor and os.path.abspath(inductor) != default:
        chosen[INDUCTOR_CACHE_VAR] = inductor
    triton = os.environ.get(TRITON_CACHE_VAR)
    if triton and os.path.dirname(os.path.abspath(triton)) != os.path.join(default, "triton"):
        chosen[TRITON_CACHE_VAR] = triton
    return chosen


def _memoized_cache_path_clear() -> Callable[[], None]:
    """inductor memoizes the path of its benchmark-result cache (``CacheBase.get_local_cache_path``)
    on first use; clearing it at each switch gives each side of the switch its own."""
    try:
        from torch._inductor.codecache import CacheBase

        return CacheBase.get_local_cache_path.cache_clear
    except (ImportError, AttributeError):
        return lambda: None


class _TorchCacheRouting:
    """Sets the cache variables for the calls inside and puts back what was there after, as torch's
    own ``fresh_cache`` does: inductor and Triton read them on every use. Re-entrant."""

    def __init__(self, variables: dict[str, str]):
        self.variables = variables
        self.forget_memoized = _memoized_cache_path_clear() if variables else (lambda: None)
        self.saved: list[dict[str, str | None]] = []

    def __enter__(self):
        self.saved.append({name: os.environ.get(name) for name in self.variables})
        os.environ.update(self.variables)
        self.forget_memoized()
        return self

    def __exit__(self, *_exc):
        for name, value in self.saved.pop().items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.forget_memoized()


def probe_cpu_vector_isa() -> float:
    """Seconds spent on torch's CPU vector-instruction probe, asked for here where it is cheapest.

    inductor dry-compiles and loads a test library per x86 vector ISA (AVX2, AVX-512, ...) in each
    cache folder it meets and remembers the answer for the process: a few seconds per ISA on a small
    CPU, paid again in every new sdopt cache entry. Asked outside sdopt's routing, the probe lands in
    torch's own cache folder once per machine, and every entry after reuses the process's answer."""
    started = time.perf_counter()
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        valid_vec_isa_list()
    except Exception:  # a torch without it, or a probe that breaks: the compile asks again and reports
        return 0.0
    return time.perf_counter() - started


def _holds_graphs(inductor_dir: str) -> bool:
    """Whether inductor's FX-graph cache in ``inductor_dir`` has any graph in it."""
    try:
        with os.scandir(os.path.join(inductor_dir, "fxgraph")) as entries:
            return any(entries)
    except OSError:
        return False


def _graph_cache_lookups(counters: dict) -> tuple[int, int]:
    """(graphs inductor found in its FX-graph cache, graphs it had to compile) so far in this
    process, from torch's ``counters``."""
    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]


def signature_text(inputs: tuple) -> str:
    """The input shapes of a call, e.g. ``2x4x64x64, 2, 2x77x768, none (float32)``."""
    tensors = [t for t in inputs if t is not None]
    shapes = ", ".join("none" if t is None else "x".join(map(str, t.shape)) or "scalar" for t in inputs)
    return f"{shapes} ({str(tensors[0].dtype).removeprefix('torch.')})" if tensors else shapes


@dataclass
class ArtifactCache:
    """One sdopt cache entry: a folder per architecture, torch version and settings.

    While sdopt's compiled code runs (``torch_caches()``, ``wrap()``), torch's compiler caches are
    read and written here: inductor's FX graphs and C++/Triton kernels, Triton's cache, dynamo's
    profiles; so a new process compiles warm, and deleting the folder makes the next compile cold.
    ``artifacts.bin`` holds torch's portable artifacts (``torch.compiler.save_cache_artifacts``);
    ``meta.json`` marks the folder as sdopt's and keeps each input signature's last cold compile time.
    """

    root: Path
    key: str
    model: str
    settings: str
    compiles: dict[str, dict] = field(default_factory=dict, repr=False, compare=False)  # this process's, by signature_text
    _routing: _TorchCacheRouting | None = field(default=None, init=False, repr=False, compare=False)
    _users_dirs: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    # graphs from earlier runs: without them a compile is cold even where a graph repeated within
    # this run (a block compiled twice across a graph break) is found in the cache
    _earlier_graphs: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def for_module(cls, module: torch.nn.Module, config: CompileConfig, root: Path | None = None) -> ArtifactCache:
        arch = architecture_hash(module)
        version = torch.__version__.replace("+", "_")
        return cls(Path(root or default_cache_dir()).absolute(), f"{arch}-torch{version}-{config.settings()}", arch, config.settings())

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def torch_caches(self) -> _TorchCacheRouting:
        """A context manager: inside, torch's compiler caches are in this entry, except those whose
        variable the user set (``TORCHINDUCTOR_CACHE_DIR``: all of them; ``TRITON_CACHE_DIR``:
        Triton's). The first use marks the folder as sdopt's before torch writes into it; where it
        cannot be written, torch's caches stay where they are, with a warning."""
        if self._routing is None:
            self._users_dirs = users_cache_dirs()
            variables = {}
            if INDUCTOR_CACHE_VAR not in self._users_dirs:
                variables[INDUCTOR_CACHE_VAR] = str(self.folder)
                if TRITON_CACHE_VAR not in self._users_dirs:
                    variables[TRITON_CACHE_VAR] = str(self.folder / "triton")
            try:
                self._write_meta(self.meta())
            except OSError as error:
                warnings.warn(f"sdopt: cannot write the compile cache {self.folder} ({error}); torch's caches stay where they are")
                variables = {}
            self._routing = _TorchCacheRouting(variables)
            self._earlier_graphs = _holds_graphs(variables.get(INDUCTOR_CACHE_VAR) or os.environ.get(INDUCTOR_CACHE_VAR) or _torch_default_cache_dir())
        return self._routing

    def wrap(self, compiled: CompiledForward) -> Callable:
        """``compiled`` with every call, recompiles included, inside ``torch_caches()``; each call
        that compiles is noted under its ``signature_text``: seconds, and graphs found in the cache."""
        from torch._dynamo.utils import counters

        routing = self.torch_caches()
        stats = compiled.stats
        probes_cpu = compiled.config.mode != "trace" and compiled.config.backend == "inductor"

        def call(*inputs):
            if not stats.cpu_probed and probes_cpu and _on_cpu(inputs):
                stats.cpu_probe_seconds, stats.cpu_probed = probe_cpu_vector_isa(), True
            compilations, seconds = stats.compilations, stats.compile_seconds
            lookups = _graph_cache_lookups(counters)
            with routing:
                output = compiled(*inputs)
            if stats.compilations > compilations:
                self._note_compile(signature_text(inputs), stats.compile_seconds - seconds, lookups, _graph_cache_lookups(counters))
            return output

        return call

    def _note_compile(self, signature: str, seconds: float, before: tuple[int, int], after: tuple[int, int]) -> None:
        hits, misses = (max(0, a - b) for a, b in zip(after, before))  # torch's tests may clear the counters
        noted = self.compiles.setdefault(signature, {"seconds": 0.0, "graphs_cached": 0, "graphs_compiled": 0})
        noted["seconds"] += seconds
        noted["graphs_cached"] += hits
        noted["graphs_compiled"] += misses

    def load(self) -> bool:
        """Hand the stored portable artifacts to torch, which writes them into its caches (here,
        inside ``torch_caches()``); True when there were some."""
        path = self.folder / ARTIFACTS
        if not path.is_file():
            return False
        with self.torch_caches():
            try:
                loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
            except Exception as error:  # a stale or truncated artifact must never stop a run: compile cold
                loaded, reason = None, str(error)
            else:
                reason = "torch could not read it"
        if loaded is None:
            warnings.warn(f"sdopt: ignoring unreadable compile cache {path}: {reason}")
            return False
        self._earlier_graphs = True
        return True

    def save(self) -> Path | None:
        """Store torch's portable artifacts and the meta. A signature compiled cold (nothing from the
        cache, or the cache held no graphs of earlier runs) records its cold time; a warm one keeps
        the cold time measured before. The folder, or None when torch had no artifacts to save."""
        saved = torch.compiler.save_cache_artifacts()
        if saved:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / (ARTIFACTS + ".partial")
            partial.write_bytes(saved[0])
            os.replace(partial, self.folder / ARTIFACTS)
        meta = self.meta()
        for signature, noted in self.compiles.items():
            kept = meta["compiles"].setdefault(signature, {})
            kept.update(last_seconds=round(noted["seconds"], 2), graphs_cached=noted["graphs_cached"], graphs_compiled=noted["graphs_compiled"])
            if noted["graphs_compiled"] and (not noted["graphs_cached"] or not self._earlier_graphs):
                kept["cold_seconds"] = kept["last_seconds"]
        self._write_meta(meta)
        return self.folder if saved else None

    def meta(self) -> dict:
        """The entry's meta.json, or a new one with this entry's mark, names and the time."""
        meta = _entry_meta(self.folder) or {
            "written_by": WRITTEN_BY, "key": self.key, "model": self.model, "torch": torch.__version__,
            "settings": self.settings, "created": _timestamp(), "compiles": {},
        }
        meta["last_used"] = _timestamp()
        return meta

    def _write_meta(self, meta: dict) -> None:
        """Written whole or not at all: a half-written meta.json would leave the folder unmarked."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (META + ".partial")
        partial.write_text(json.dumps(meta, indent=2))
        os.replace(partial, self.folder / META)

    def note(self) -> str:
        """What this process's compiles found in the cache, per input signature, with the cold
        compile time of the same signature where one was measured; and where torch's caches are
        when the user's variables put them elsewhere."""
        kept = (_entry_meta(self.folder) or {}).get("compiles", {})
        here = self._routing is not None and INDUCTOR_CACHE_VAR in self._routing.variables
        where = "sdopt's compile cache" if here else "inductor's cache"
        parts = []
        for signature, noted in self.compiles.items():
            cached, compiled, took = noted["graphs_cached"], noted["graphs_compiled"], f"{noted['seconds']:.1f} s"
            cold = kept.get(signature, {}).get("cold_seconds")
            was = f"; its cold compile took {cold:.1f} s" if cold else "; no cold compile of these inputs on record"
            if not cached and not compiled:
                parts.append(f"compiled inputs {signature} in {took} (no graph went through inductor's cache)")
            elif not self._earlier_graphs:
                parts.append(f"cold compile of inputs {signature}: {took}, {where} held no graphs before this run")
            elif not cached:
                parts.append(f"cold compile of inputs {signature}: {took}, none of its {compiled} graph(s) in {where}")
            elif not compiled:
                parts.append(f"warm compile of inputs {signature}: {took}, all {cached} graph(s) from {where}{was}")
            else:
                parts.append(f"partly warm compile of inputs {signature}: {took}, {cached} of {cached + compiled} graph(s) from {where}{was}")
        if INDUCTOR_CACHE_VAR in self._users_dirs:
            parts.append(f"torch's caches are in {INDUCTOR_CACHE_VAR}={self._users_dirs[INDUCTOR_CACHE_VAR]} "
                         "(set in the environment), which `python -m sdopt cache purge` leaves alone")
        elif TRITON_CACHE_VAR in self._users_dirs:
            parts.append(f"Triton's cache is in {TRITON_CACHE_VAR}={self._users_dirs[TRITON_CACHE_VAR]} "
                         "(set in the environment), which `python -m sdopt cache purge` leaves alone")
        return "; ".join(parts)


def _entry_meta(folder: Path) -> dict | None:
    """The meta.json of a folder sdopt's cache wrote, or None for anything else (a link, a file,
    a folder without sdopt's mark or whose mark names another key)."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return None
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("written_by") != WRITTEN_BY or meta.get("key") != folder.name:
        return None
    meta.setdefault("compiles", {})
    return meta


def _folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file torch removes while this counts
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def _items(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except OSError:  # no such folder, or not a folder
        return []


def cache_entries(root: Path | None = None) -> list[dict]:
    """The entries sdopt wrote under ``root``: their meta.json fields and ``bytes`` on disk,
    torch's cache files included."""
    entries = []
    for item in _items(Path(root or default_cache_dir())):
        meta = _entry_meta(item)
        if meta is not None:
            entries.append({**meta, "bytes": _folder_bytes(item)})
    return entries


def foreign_items(root: Path | None = None) -> list[str]:
    """The names under ``root`` that are not sdopt cache entries: never listed, never purged."""
    return [item.name for item in _items(Path(root or default_cache_dir())) if _entry_meta(item) is None]


def purge_cache(root: Path | None = None, key: str | None = None) -> list[str]:
    """Delete every sdopt entry under ``root`` (or the one named ``key``), and nothing else;
    returns the keys deleted."""
    root = Path(root or default_cache_dir())
    doomed = [entry["key"] for entry in cache_entries(root) if key is None or entry["key"] == key]
    for name in doomed:
        shutil.rmtree(root / name)
    return doomed
