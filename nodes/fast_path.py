"""The fast path: one chain of forward-level techniques, and the gate that sends a call round it.

``FastPath`` is the DIFFUSION_MODEL wrapper (for a model ComfyUI runs no such wrappers around, SD3's
MMDiT, it sits behind ``ForwardRouter``, an APPLY_MODEL wrapper) that the forward-level nodes
configure. Each such node declares a ``ChainMember`` in its own module: its place in the chain, how it
changes the forward, what it counts as warm-up and the record it writes from its stats; this module
knows none of them by name. It keeps the chain (members innermost first, whatever order the nodes come
in), the eager gate (``_why_eager``: the calls the chain cannot serve run as ComfyUI would) and
``fast_path_clone``, what those nodes call.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from ..errors import Unavailable
from ..families import DiffusionCall
from ..measure.profiler import active_run
from .environment import ModelFamily, model_family, non_dynamic_clone
from .patching import fall_back_or_raise, record_in_run, record_model, set_wrappers, trim_heap_after_sampling, wrapper_types

FAST_PATH_KEY = "sdopt.fast_path"
# sdopt Step Cache's first_block patches carry their cache in this attribute: under regional compile
# they run in the forward (only the blocks are compiled), so the fast path passes them on rather than
# going eager
BLOCK_CACHE_ATTRIBUTE = "sdopt_first_block_cache"
NEVER_CALLED = "ComfyUI never called the diffusion model through the fast path in this run (it ran no DIFFUSION_MODEL wrapper)"
_KEPT_OPTIONS = ("optimized_attention_override", "patches_replace")
FIRST_BLOCK_EAGER = ("sdopt Step Cache first_block, which decides per call between the blocks: only Compile's "
                     "compile_regional (no CUDA Graph) runs beside it")
PLAIN_STEP = "plain"
# An option value with this attribute is set for the chain's forward only (Compile's attention route):
# a call that bypasses the chain runs as ComfyUI would, so without it
CHAIN_ONLY_ATTRIBUTE = "sdopt_chain_only"


def schedule_position(transformer_options: dict) -> float | None:
    """The fraction of the sampling schedule done at this call (from ComfyUI's ``sample_sigmas`` and
    the call's ``sigmas``), or None where the sampler did not say."""
    schedule, sigmas = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if schedule is None or sigmas is None or len(schedule) < 2:
        return None
    done = int((schedule[:-1] > float(sigmas.max()) * (1 + 1e-5)).sum())
    return done / (len(schedule) - 1)


def _diffusion_forward(options: dict, method: str, unet, *tensors):
    """The diffusion model's forward on its tensor inputs, in its family's order, with no control:
    its class's ``method`` (``DiffusionCall.plain_forward``), never a forward routed per instance."""
    return getattr(type(unet), method)(unet, *tensors, None, dict(options))


def _bind(call: DiffusionCall, args: tuple, kwargs: dict) -> tuple[tuple, object, object, dict] | None:
    """(tensor inputs in ``call``'s order, control, transformer_options, the other keyword inputs) of
    a call of the diffusion model's forward, which takes ``call.tensor_inputs``, then ``control`` and
    ``transformer_options``; None where it got more positional inputs than that."""
    names = (*call.tensor_inputs, "control", "transformer_options")
    if len(args) > len(names):
        return None
    bound, extra = dict(zip(names, args)), {}
    for name, value in kwargs.items():
        (bound if name in names else extra)[name] = value
    return tuple(bound.get(name) for name in call.tensor_inputs), bound.get("control"), bound.get("transformer_options", {}), extra


def _as_comfy_would(call: DiffusionCall, args: tuple, kwargs: dict, transformer_options) -> tuple[tuple, dict]:
    """(args, kwargs) of a call that bypasses the chain, without the options set for the chain only."""
    if not isinstance(transformer_options, dict):
        return args, kwargs
    chain_only = [name for name, value in transformer_options.items() if getattr(value, CHAIN_ONLY_ATTRIBUTE, False)]
    if not chain_only:
        return args, kwargs
    own = {name: value for name, value in transformer_options.items() if name not in chain_only}
    place = len(call.tensor_inputs) + 1
    if len(args) > place:
        return (*args[:place], own, *args[place + 1:]), kwargs
    return args, {**kwargs, "transformer_options": own}


def _identity(option) -> tuple | int:
    """What a kept option is, for telling runners apart: ComfyUI merges ``patches_replace`` into new
    dicts on every call, so it is told by the patches it holds."""
    if isinstance(option, dict):
        return tuple((name, tuple(map(id, patches.values()))) for name, patches in option.items())
    return id(option)


def _only_block_cache_patches(transformer_options: dict) -> bool:
    replace = transformer_options.get("patches_replace") or {}
    return (not transformer_options.get("patches") and set(replace) == {"dit"}
            and all(block_cache_of(patch) is not None for patch in replace["dit"].values()))


def block_cache_of(patch):
    """The ``FirstBlockCache`` of an sdopt first_block patch, None for any other patch."""
    return getattr(patch, BLOCK_CACHE_ATTRIBUTE, None)


def _why_eager(executor, control, transformer_options, kwargs: dict, blocks_compiled_only: bool = False) -> str | None:
    """Why this call runs as ComfyUI would, without the chain; None where the chain runs it.
    ``blocks_compiled_only``: the chain is regional compile alone, which leaves the forward's own
    code, and so sdopt's block patches, running."""
    if not isinstance(transformer_options, dict):
        return "inputs that do not fit the family's call (no transformer_options where it expects them)"
    if control is not None:
        return "ControlNet (control) inputs"
    if transformer_options.get("patches") or transformer_options.get("patches_replace"):
        if not _only_block_cache_patches(transformer_options):
            return "transformer patches (IP-Adapter, attention patches...)"
        if not blocks_compiled_only:
            return FIRST_BLOCK_EAGER
    if any(value is not None for value in kwargs.values()):
        return f"extra model inputs ({', '.join(sorted(kwargs))})"
    if getattr(executor, "idx", 0) + 1 < len(getattr(executor, "wrappers", ())):
        return "another DIFFUSION_MODEL wrapper runs inside this one"
    return None


@dataclass(frozen=True)
class EagerCalls:
    """What a sampling run's calls that bypassed the chain come to, for every member's record: the
    long note (each reason with its count) and the one-line shortfall ("" where none did)."""

    note: str
    short: str


@dataclass(frozen=True)
class Warmup:
    """What a part of a runner has spent on set-up so far: its kind for the profiler (``"compile"``,
    ``"capture"``), how many times, and the seconds."""

    kind: str
    count: int
    seconds: float


class ChainMember:
    """One forward-level technique on the fast path, declared by its node's module as one instance.

    ``place`` orders the chain, innermost first: a member that selects which forward a call runs
    (the step cache, 10) sits inside one that compiles the forward it is given (20), which sits inside
    one that replays what it is given (CUDA graphs, 30). A member overrides what it does; the defaults
    leave the forward as it is and count nothing.
    """

    node: str = ""  # the node class whose record the member writes
    place: int = 0
    selects_forward = False  # whether it picks, per call, which kind of forward runs (at most one member)
    speed_only = False  # whether the output stays eager's: a run without the node is the run's eager twin

    def wrap(self, fast_path: "FastPath", unet, fn: Callable, call: Callable, config, options: dict):
        """(forward, the part that holds its stats, what keeps its code on disk or None): ``fn``, the
        forward of the members inside this one, changed by this member; ``call`` is the plain
        ``call(unet, *tensors)`` that ``fn`` binds."""
        return fn, None, None

    def warmup(self, part) -> Warmup | None:
        return None

    def keeps_forward_code(self, config) -> bool:
        """Whether the forward's own Python code still runs under this member (so block patches do)."""
        return False

    def new_state(self, config):
        """What the member keeps per fast path across calls (a step cache's schedule), or None."""
        return None

    def warmed_up(self, state, part, cache) -> None:
        """After a call whose warm-up count rose: e.g. keep what was compiled."""

    def begin_run(self, state) -> None:
        """As a sampling run starts."""

    def end_run(self, state) -> None:
        """As a sampling run ends, finished or not."""

    def select(self, state, config, run: Callable, transformer_options: dict, tensors: tuple):
        """A selecting member's answer to one call: ``run(kind, tensors)`` for the kinds it picks."""
        raise NotImplementedError

    def forward_of(self, kind: str, options: dict, config) -> Callable:
        """A selecting member's ``call(unet, *tensors)`` for one of its kinds of forward."""
        raise NotImplementedError

    def fallback(self, reason: str) -> tuple[str, str, str]:
        """(active, note, short) of the record where the member cannot run and the model runs eager."""
        return "eager", f"{reason}; running eager", f"runs eager: {reason}"

    def record(self, fast_path: "FastPath", config, state, parts: list, eager: EagerCalls) -> tuple[str, str, str]:
        """(active, note, short) of the member's record after a sampling run, from its parts' stats."""
        raise NotImplementedError


class FastPath:
    """The DIFFUSION_MODEL wrapper of the forward-level nodes (or what ``ForwardRouter`` calls): one
    per patched clone.

    The diffusion model is called with its tensor inputs only (those ``family``'s call names:
    SDXL's ``y`` too), through the members in ``configs`` (a ``ChainMember`` each, with its config),
    innermost first. A selecting member (the step cache) picks per call which kind of forward runs,
    and each kind is compiled and captured on its own. Its state (compiled code, graphs) is shared by
    clones made downstream (e.g. by a LoRA loader); the weight identity check makes those use their
    own weights, and each member's per-run state starts afresh with every sampling run.
    """

    def __init__(self, configs: dict, family: ModelFamily, cache_root=None):
        unknown = [member for member in configs if not isinstance(member, ChainMember)]
        if unknown:
            raise ValueError(f"not a member of the fast path's chain: {unknown}")
        members = sorted((member for member, config in configs.items() if config is not None), key=lambda member: member.place)
        if len({member.place for member in members}) < len(members) or sum(member.selects_forward for member in members) > 1:
            raise ValueError(f"two members of the fast path's chain at one place, or two that select the forward: {members}")
        self.configs = {member: configs[member] for member in members}
        self.states = {member: member.new_state(config) for member, config in self.configs.items()}
        self.selector = next((member for member in members if member.selects_forward), None)
        self.family = family
        self.cache_root = cache_root
        self.runners: dict[tuple, tuple] = {}
        self.eager_reasons: dict[str, int] = {}
        self.calls = 0  # in the current sampling run
        self.requested: dict[str, str] = {}
        self.notes: dict[str, Callable[[], str]] = {}  # per node: what else its record says after a run

    def _member(self, node: str) -> ChainMember | None:
        return next((member for member in self.configs if member.node == node), None)

    def config_of(self, node: str):
        """The config of ``node``'s member, None where the chain has none."""
        member = self._member(node)
        return None if member is None else self.configs[member]

    def state_of(self, node: str):
        member = self._member(node)
        return None if member is None else self.states[member]

    def stats(self, node: str) -> list:
        """The stats of ``node``'s part of every runner that has one."""
        member = self._member(node)
        return [parts[member].stats for _, _, parts, _ in self.runners.values() if member in parts]

    @property
    def keeps_forward_code(self) -> bool:
        """Whether the forward's own code still runs whatever the chain does (regional compile alone)."""
        return all(member.keeps_forward_code(config) for member, config in self.configs.items())

    def with_config(self, member: ChainMember, config) -> "FastPath":
        """A new fast path (fresh compiled code, graphs and per-run state) with ``member``'s config replaced."""
        new = FastPath({**self.configs, member: config}, self.family, self.cache_root)
        new.requested = dict(self.requested)
        new.notes = dict(self.notes)
        return new

    def _runner(self, unet, options: dict, kind: str = PLAIN_STEP):
        """(fn, {member: the part that holds its stats}, what keeps compiled code or None) of one
        kind of call: the plain forward, or one the selecting member picks; each kind compiles and
        captures its own code."""
        key = (id(unet), tuple(_identity(options.get(name)) for name in _KEPT_OPTIONS), kind)
        if key in self.runners and self.runners[key][0] is unet:
            return self.runners[key][1:]
        if kind == PLAIN_STEP:
            call = functools.partial(_diffusion_forward, options, self.family.call.plain_forward)
        else:
            call = self.selector.forward_of(kind, options, self.configs[self.selector])
        fn, parts, cache = functools.partial(call, unet), {}, None
        for member, config in self.configs.items():
            fn, part, entry = member.wrap(self, unet, fn, call, config, options)
            if part is not None:
                parts[member] = part
            cache = entry or cache
        self.runners[key] = (unet, fn, parts, cache)
        return fn, parts, cache

    def __call__(self, executor, *args, **kwargs):
        self.calls += 1
        bound = _bind(self.family.call, args, kwargs)
        if bound is None:
            reason = f"more positional inputs than {self.family.described.title}'s call takes"
        else:
            tensors, control, transformer_options, extra = bound
            reason = _why_eager(executor, control, transformer_options, extra, self.keeps_forward_code)
        if reason:
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
            if bound is not None:
                args, kwargs = _as_comfy_would(self.family.call, args, kwargs, transformer_options)
            return executor(*args, **kwargs)
        options = {name: transformer_options[name] for name in _KEPT_OPTIONS if transformer_options.get(name)}
        run = functools.partial(self._run, executor.class_obj, options)
        if self.selector is None:
            return run(PLAIN_STEP, tensors)
        selector = self.selector
        return selector.select(self.states[selector], self.configs[selector], run, transformer_options, tensors)

    def _run(self, unet, options: dict, kind: str, tensors: tuple):
        fn, parts, cache = self._runner(unet, options, kind)
        before = {member: member.warmup(part) for member, part in parts.items()}
        with _malloc_graph_paused():
            output = fn(*tensors)
        run, inner_seconds = active_run(), 0.0
        for member, part in parts.items():  # innermost first: an outer part's warm-up calls the inner ones
            then, now = before[member], member.warmup(part)
            if now is None:
                continue
            count, seconds = now.count - then.count, now.seconds - then.seconds
            if count:
                member.warmed_up(self.states[member], part, cache)
                if run is not None:
                    run.warm_up(now.kind, seconds - inner_seconds)  # an inner warm-up in this call is counted once, there
            inner_seconds += seconds
        return output

    def begin_run(self) -> None:
        self.calls, self.eager_reasons = 0, {}
        for member, state in self.states.items():
            member.begin_run(state)

    def end_run(self) -> None:
        """Every member's state released, and the record of each member whose node asked, filed in the run."""
        for member, state in self.states.items():
            member.end_run(state)
        eager, run = self._eager_calls(), active_run()
        for member, config in self.configs.items():
            if member.speed_only and run is not None:
                run.speed_only_nodes.add(member.node)
            if member.node in self.requested:
                parts = [parts[member] for _, _, parts, _ in self.runners.values() if member in parts]
                record_in_run(member.node, self.requested[member.node], *member.record(self, config, self.states[member], parts, eager))

    def _eager_calls(self) -> EagerCalls:
        reasons = self.eager_reasons
        note = "; ".join(filter(None, [*(f"eager for {reason} ({n}x)" for reason, n in reasons.items()), self.family.unknown_note]))
        short = f"eager for {_some_reasons(reasons)}" if reasons else ""
        if not self.calls:
            return EagerCalls("; ".join(filter(None, [NEVER_CALLED, note])), "did nothing: " + NEVER_CALLED)
        return EagerCalls(note, short)


def _some_reasons(counts: dict[str, int]) -> str:
    """The reasons some calls ran eagerly, with how many: one line."""
    return ", ".join(f"{reason} ({n}x)" for reason, n in counts.items())


@contextmanager
def _malloc_graph_paused():
    """ComfyUI 0.38's memory compiler records allocations into malloc graphs; capture must stay out."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    pause = getattr(prefetch, "pause_malloc_graph", None)
    with pause() if pause else nullcontext():
        yield


class _OwnForward:
    """A diffusion model's own forward, as the executor that the fast path calls eagerly."""

    def __init__(self, unet, forward: Callable):
        self.class_obj, self.forward = unet, forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class ForwardRouter:
    """The APPLY_MODEL wrapper that puts ``fast_path`` in front of a diffusion model around which
    ComfyUI runs no DIFFUSION_MODEL wrappers (SD3's MMDiT): for the length of each call the model's
    forward goes through the fast path, as ComfyUI's own object patches do, and then is restored."""

    def __init__(self, fast_path: FastPath):
        self.fast_path = fast_path

    def __call__(self, executor, *args, **kwargs):
        unet = executor.class_obj.diffusion_model
        routed = unet.__dict__.get("forward")
        own = _OwnForward(unet, routed or functools.partial(type(unet).forward, unet))
        unet.forward = functools.partial(self.fast_path, own)
        try:
            return executor(*args, **kwargs)
        finally:
            if routed is None:
                del unet.forward
            else:
                unet.forward = routed


def fast_path_of(model) -> FastPath | None:
    types = wrapper_types()
    for kind in (types.DIFFUSION_MODEL, types.APPLY_MODEL):
        for fn in model.get_wrappers(kind, FAST_PATH_KEY):
            found = fn.fast_path if isinstance(fn, ForwardRouter) else fn
            if isinstance(found, FastPath):
                return found
    return None


def install_fast_path(model, fast_path: FastPath) -> None:
    """Put ``fast_path`` on ``model``, each sampling run opening and closing its members' state and
    filing their records."""

    def report_after_sampling(executor, *args, **kwargs):
        fast_path.begin_run()
        try:
            return executor(*args, **kwargs)
        finally:
            fast_path.end_run()

    # SAMPLER_SAMPLE runs inside every OUTER_SAMPLE wrapper, so the profiler's run is open here
    entry = {"DIFFUSION_MODEL": fast_path} if fast_path.family.call.runs_wrappers else {"APPLY_MODEL": ForwardRouter(fast_path)}
    set_wrappers(model, FAST_PATH_KEY, {**entry, "SAMPLER_SAMPLE": report_after_sampling})


def fast_path_clone(model, member: ChainMember, requested: str, problem: Unavailable | None, on_unavailable: str, config):
    """(clone, note) for a forward-level node: the clone's fast path gets ``config`` at ``member``'s
    place (the rest of the chain as the input model had it). Where ``problem`` says the technique
    cannot run, or where ComfyUI has no non-dynamic copy of a dynamic VRAM model for it:
    ``fall_back_or_raise``, then the clone as it is with the member's fallback record, and a None note."""
    unavailable = fall_back_or_raise(on_unavailable, problem, "run eager")
    m, path_note, delegate_problem = (model.clone(), "", None) if unavailable else non_dynamic_clone(model)
    unavailable = unavailable or fall_back_or_raise(on_unavailable, delegate_problem, "run eager")
    if unavailable:
        trim_heap_after_sampling(m)
        record_model(m, member.node, requested, *member.fallback(unavailable))
        return m, None
    current = fast_path_of(m)
    fast_path = current.with_config(member, config) if current else FastPath({member: config}, model_family(m))
    fast_path.requested[member.node] = requested
    install_fast_path(m, fast_path)
    return m, "; ".join(filter(None, [path_note, fast_path.family.unknown_note]))
