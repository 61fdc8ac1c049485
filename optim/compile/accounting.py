"""What torch did for a compiled model, attributed to the forward that is running: compilations
and their time (dynamo's callbacks), recompile reasons (its guard failures), graph breaks and the
functions it gave up on (its compilation metrics and recompile-limit warning), and the graphs this
model ran that another compile made (torch's profiler names each compiled region)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import types
from dataclasses import dataclass, field

import torch

from .private_code import sweep_dead_guards

# The whole-model mode's own wrapper (``modes._whole``): split because what it calls is, so never named as
# the function split
_WRAPPER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modes.py")


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
    """One compiled model's account: compilations and their time, why it recompiled, what torch did
    short of one graph per input signature, and what ran eagerly instead (the record's stats line)."""

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
    ours = metric.co_filename == _WRAPPER_FILE
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
    if not _running:
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
