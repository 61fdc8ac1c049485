"""The fast path: one chain of UNet-forward techniques (step cache, compile, CUDA graph).

``FastPath`` is the DIFFUSION_MODEL wrapper (for a model ComfyUI runs no such wrappers around, SD3's
MMDiT, it sits behind ``ForwardRouter``, an APPLY_MODEL wrapper) that SDOptStepCache, SDOptCompile
and SDOptCUDAGraph configure, each at its place in ``CHAIN``: the step cache picks which forward a call runs (the whole
UNet or its shallow branch), compile compiles it and a CUDA graph replays it. ``fast_path_clone`` is
what those nodes call; ``ComfyUNetBlocks`` shows ComfyUI's UNetModel to the step cache.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from ..errors import Unavailable
from ..families import DiffusionCall, Family
from ..measure.profiler import active_run
from .glue import (ModelFamily, call_key, fall_back_or_raise, model_family, non_dynamic_clone, record_in_run, record_model, set_wrappers,
                   trim_heap_after_sampling, wrapper_types)

FAST_PATH_KEY = "sdopt.fast_path"
# sdopt Step Cache's first_block patches carry their cache in this attribute: under regional compile
# they run in the forward (only the blocks are compiled), so the fast path passes them on rather than
# going eager
BLOCK_CACHE_ATTRIBUTE = "sdopt_first_block_cache"
NEVER_CALLED = "ComfyUI never called the diffusion model through the fast path in this run (it ran no DIFFUSION_MODEL wrapper)"
# Below this, inductor's per-step copy of NCHW conv weights costs microseconds: not worth a note.
NCHW_NOTE_MIN_BYTES = 2**20
_KEPT_OPTIONS = ("optimized_attention_override", "patches_replace")
FIRST_BLOCK_EAGER = ("sdopt Step Cache first_block, which decides per call between the blocks: only Compile's "
                     "compile_regional (no CUDA Graph) runs beside it")
PLAIN_STEP, FULL_STEP, SHALLOW_STEP = "plain", "full", "shallow"


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


def _cached_full_forward(options: dict, branch: int, unet, *tensors):
    """(output, deep features) of the whole UNet, for the step cache to keep."""
    from ..optim.step_cache import full_forward

    return full_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors)


def _cached_shallow_forward(options: dict, branch: int, unet, *tensors_and_deep):
    """The UNet's output from its shallow branch and kept deep features (the last input)."""
    from ..optim.step_cache import shallow_forward

    *tensors, deep = tensors_and_deep
    return shallow_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors, deep=deep)


class ComfyUNetBlocks:
    """ComfyUI's UNetModel as the step cache's ``UNetBlocks``: the same calls, in the same order,
    with the same transformer options as its ``_forward`` without control or patches (the fast path
    runs those calls eagerly)."""

    def __init__(self, unet, transformer_options: dict):
        from comfy.ldm.modules.diffusionmodules import openaimodel

        self.unet, self.options, self.host = unet, transformer_options, openaimodel
        self.depth = len(unet.input_blocks)

    def _block(self, module, h, emb, context, output_shape=None):
        return self.host.forward_timestep_embed(module, h, emb, context, self.options, output_shape,
                                                num_video_frames=getattr(self.unet, "default_num_video_frames", None))

    def embed(self, x, timesteps, y):
        unet = self.unet
        self.options["original_shape"] = list(x.shape)
        self.options["transformer_index"] = 0
        emb = unet.time_embed(self.host.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
        return emb if unet.num_classes is None else emb + unet.label_emb(y)

    def down(self, index, h, emb, context):
        self.options["block"] = ("input", index)
        return self._block(self.unet.input_blocks[index], h, emb, context)

    def middle(self, h, emb, context):
        self.options["block"] = ("middle", 0)
        return h if self.unet.middle_block is None else self._block(self.unet.middle_block, h, emb, context)

    def up(self, index, h, skip, emb, context, output_shape):
        self.options["block"] = ("output", index)
        return self._block(self.unet.output_blocks[index], torch.cat([h, skip], dim=1), emb, context, output_shape)

    def head(self, h, x):
        h = h.type(x.dtype)
        return self.unet.id_predictor(h) if self.unet.predict_codebook_ids else self.unet.out(h)


def comfy_unet_blocks(unet, transformer_options: dict | None = None) -> ComfyUNetBlocks | None:
    """``unet`` seen as the step cache's blocks, or None where it is not ComfyUI's UNetModel layout
    (as many down as up blocks, a time embedding, an output head)."""
    layout = ("input_blocks", "middle_block", "output_blocks", "time_embed", "out", "model_channels")
    if not all(hasattr(unet, name) for name in layout) or len(unet.input_blocks) != len(unet.output_blocks):
        return None
    return ComfyUNetBlocks(unet, {} if transformer_options is None else transformer_options)


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


def _identity(option) -> tuple | int:
    """What a kept option is, for telling runners apart: ComfyUI merges ``patches_replace`` into new
    dicts on every call, so it is told by the patches it holds."""
    if isinstance(option, dict):
        return tuple((name, tuple(map(id, patches.values()))) for name, patches in option.items())
    return id(option)


def _without(keys: frozenset, options: dict) -> dict:
    return options if keys.isdisjoint(options) else {name: value for name, value in options.items() if name not in keys}


def positionless_block_options(family: Family | None, options: dict) -> Callable[[dict], dict] | None:
    """What regional compile hands each block for its options: ComfyUI's without the keys that say
    the block's place (``Family.block_position_options``), where nothing in the call reads them: no
    patch keyed by place, and no attention override but sdopt's. None (as ComfyUI gives them) elsewhere,
    and for a model of a family sdopt does not know, whose blocks may read them."""
    from .attention import OVERRIDE_KEY, POSITION_BLIND

    keys = frozenset(family.block_position_options if family is not None else ())
    override = options.get(OVERRIDE_KEY)
    if not keys or options.get("patches_replace") or (override is not None and not getattr(override, POSITION_BLIND, False)):
        return None
    return functools.partial(_without, keys)


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


# The fast path's chain, innermost first. The step cache picks which forward a call runs (the whole
# UNet or its shallow branch); compile then compiles that forward itself (so it comes first of the
# wrappers), and a CUDA graph captures what compile made, so a graph replays compiled kernels and
# never the other way round. The order of the nodes in a workflow does not matter.
STEP_CACHE, COMPILE, GRAPH = "step_cache", "compile", "graph"
CHAIN = (STEP_CACHE, COMPILE, GRAPH)


def _compile_transform(fast_path: "FastPath", unet, fn, call, config):
    """(forward, what holds its stats, sdopt's compile cache entry or None): ``call`` compiled."""
    from ..optim.compile import ArtifactCache, compile_forward, nchw_conv_weight_bytes

    compiled = compile_forward(unet, call, config)
    fast_path.nchw_conv_bytes = nchw_conv_weight_bytes(unet, config)
    if config.mode == "trace":
        return compiled, compiled, None
    cache = ArtifactCache.for_module(unet, config, fast_path.cache_root)
    cache.load()
    return cache.wrap(compiled), compiled, cache  # every call, recompiles too, with torch's compiler caches in sdopt's entry


def _graph_transform(fast_path: "FastPath", unet, fn, call, config):
    """(forward, what holds its stats, None): ``fn`` captured per input signature."""
    from ..optim.cuda_graph import GraphedFunction, module_weights

    graphed = GraphedFunction(fn, module_weights(unet), config)
    return graphed, graphed, None


_WRAPPERS = {COMPILE: _compile_transform, GRAPH: _graph_transform}


class FastPath:
    """The DIFFUSION_MODEL wrapper of SDOptCompile, SDOptCUDAGraph and SDOptStepCache (or what
    ``ForwardRouter`` calls): one per patched clone.

    The diffusion model is called with its tensor inputs only (those ``family``'s call names:
    SDXL's ``y`` too), through ``CHAIN``: the techniques in ``configs`` (keyed by their place in the
    chain), innermost first. With a step cache each call runs either the whole UNet (keeping its
    deep features) or its shallow branch on kept features, as the step cache's schedule says; each
    of the two is compiled and captured on its own. Its state (compiled code, graphs) is shared by
    clones made downstream (e.g. by a LoRA loader); the weight identity check makes those use their
    own weights, and the step cache starts afresh with every sampling run.
    """

    def __init__(self, configs: dict, family: ModelFamily, cache_root=None):
        from ..optim.step_cache import CacheSchedule

        unknown = set(configs) - set(CHAIN)
        if unknown:
            raise ValueError(f"not in the fast path's chain {CHAIN}: {sorted(unknown)}")
        self.configs = {name: configs[name] for name in CHAIN if configs.get(name) is not None}
        self.schedule = CacheSchedule(self.step_cache_config) if self.step_cache_config else None
        self.family = family
        self.cache_root = cache_root
        self.runners: dict[tuple, tuple] = {}
        self.eager_reasons: dict[str, int] = {}
        self.calls = 0  # in the current sampling run
        self.nchw_conv_bytes = 0
        self.cache_saved = None
        self.requested: dict[str, str] = {}
        self.notes: dict[str, Callable[[], str]] = {}  # per node: what else its record says after a run

    compile_config = property(lambda self: self.configs.get(COMPILE))
    graph_config = property(lambda self: self.configs.get(GRAPH))
    step_cache_config = property(lambda self: self.configs.get(STEP_CACHE))

    @property
    def compiles_blocks_only(self) -> bool:
        """Whether the chain is regional compile alone (the forward's own code still runs)."""
        compile_config = self.compile_config
        return set(self.configs) == {COMPILE} and compile_config.mode == "compile_regional"

    def with_config(self, name: str, config) -> "FastPath":
        """A new fast path (fresh compiled code, graphs and step cache) with ``name``'s config replaced."""
        new = FastPath({**self.configs, name: config}, self.family, self.cache_root)
        new.requested = dict(self.requested)
        new.notes = dict(self.notes)
        return new

    def _runner(self, unet, options: dict, kind: str = PLAIN_STEP):
        """(fn, {chain name: what holds its stats}, compile cache entry or None) of one kind of call:
        the plain forward, or the step cache's full or shallow one; each kind compiles and captures
        its own code."""
        key = (id(unet), tuple(_identity(options.get(name)) for name in _KEPT_OPTIONS), kind)
        if key in self.runners and self.runners[key][0] is unet:
            return self.runners[key][1:]
        if kind == PLAIN_STEP:
            call = functools.partial(_diffusion_forward, options, self.family.call.plain_forward)
        else:
            forward = _cached_full_forward if kind == FULL_STEP else _cached_shallow_forward
            call = functools.partial(forward, options, self.step_cache_config.branch)
        fn, parts, cache = functools.partial(call, unet), {}, None
        for name, config in self.configs.items():
            if name == COMPILE and config.mode == "compile_regional":
                config = dataclasses.replace(config, block_options=positionless_block_options(self.family.family, options))
            if name in _WRAPPERS:
                fn, parts[name], entry = _WRAPPERS[name](self, unet, fn, call, config)
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
            reason = _why_eager(executor, control, transformer_options, extra, self.compiles_blocks_only)
        if reason:
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
            return executor(*args, **kwargs)
        options = {name: transformer_options[name] for name in _KEPT_OPTIONS if transformer_options.get(name)}
        if self.schedule is None:
            return self._run(executor.class_obj, options, PLAIN_STEP, tensors)
        key = call_key(transformer_options)
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)
        deep = self.schedule.decide(key, shapes, schedule_position(transformer_options) if self.schedule.config.bounded else None)
        if deep is not None:
            return self._run(executor.class_obj, options, SHALLOW_STEP, (*tensors, deep))
        output, deep = self._run(executor.class_obj, options, FULL_STEP, tensors)
        self.schedule.keep(key, shapes, deep)
        return output

    def _run(self, unet, options: dict, kind: str, tensors: tuple):
        fn, parts, cache = self._runner(unet, options, kind)
        before = _warmup_counters(parts)
        with _malloc_graph_paused():
            output = fn(*tensors)
        compilations, compile_s, captures, capture_s = (now - then for now, then in zip(_warmup_counters(parts), before))
        if cache is not None and compilations:
            self.cache_saved = cache.save()
        run = active_run()
        if run is not None and compilations:
            run.warm_up("compile", compile_s)
        if run is not None and captures:
            # the capture's warm-up runs call the compiled forward: a compile in this call lies
            # inside the capture's time, and is counted once, above
            run.warm_up("capture", capture_s - compile_s)
        return output

    def stats(self) -> tuple[list, list]:
        """(compile stats, graph stats), one per runner that has them."""
        parts = [entry[2] for entry in self.runners.values()]
        return [p[COMPILE].stats for p in parts if COMPILE in p], [p[GRAPH].stats for p in parts if GRAPH in p]


def _some_reasons(counts: dict[str, int]) -> str:
    """The reasons some calls ran eagerly, with how many: one line."""
    return ", ".join(f"{reason} ({n}x)" for reason, n in counts.items())


def _warmup_counters(parts: dict) -> tuple[int, float, int, float]:
    """(compilations, compile seconds, captures, capture seconds) of a runner so far: a call that
    raises them is a warm-up step for the profiler."""
    compiled, graphed = parts.get(COMPILE), parts.get(GRAPH)
    compiles = (compiled.stats.compilations, compiled.stats.compile_seconds) if compiled else (0, 0.0)
    return compiles + ((graphed.stats.captures, graphed.stats.capture_seconds) if graphed else (0, 0.0))


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
    """Put ``fast_path`` on ``model`` and file its compile and graph figures after each sampling run."""

    requested = fast_path.requested

    def report_after_sampling(executor, *args, **kwargs):
        if fast_path.schedule is not None:
            fast_path.schedule.reset()
        fast_path.calls, fast_path.eager_reasons = 0, {}
        try:
            return executor(*args, **kwargs)
        finally:
            if fast_path.schedule is not None:
                fast_path.schedule.release()
            compile_stats, graph_stats = fast_path.stats()
            eager = "; ".join(filter(None, [*(f"eager for {reason} ({n}x)" for reason, n in fast_path.eager_reasons.items()), fast_path.family.unknown_note]))
            eager_short = f"eager for {_some_reasons(fast_path.eager_reasons)}" if fast_path.eager_reasons else ""
            if not fast_path.calls:
                eager = "; ".join(filter(None, [NEVER_CALLED, eager]))
                eager_short = "did nothing: " + NEVER_CALLED
            if "SDOptCompile" in requested and fast_path.compile_config:
                warm = "; ".join(dict.fromkeys(filter(None, (cache.note() for *_, cache in fast_path.runners.values() if cache))))
                layout = (
                    f"{fast_path.nchw_conv_bytes / 2**20:,.0f} MiB of conv weights are stored NCHW, so inductor copies them to "
                    "channels-last on every step: sdopt Precision's channels_last stores them that way once"
                ) if fast_path.nchw_conv_bytes >= NCHW_NOTE_MIN_BYTES else ""
                details = [line for s in compile_stats for line in s.details()]
                note = "; ".join(filter(None, [fast_path.notes.get("SDOptCompile", str)(), *details, warm,
                                               f"cache: {fast_path.cache_saved}" if fast_path.cache_saved else "", layout, eager]))
                active = f"{fast_path.compile_config.settings()}: " + " | ".join(s.summary() for s in compile_stats)
                short = "; ".join(dict.fromkeys(filter(None, [*(s.shortfall() for s in compile_stats), eager_short])))
                record_in_run("SDOptCompile", requested["SDOptCompile"], active, note, short)
            if "SDOptStepCache" in requested and fast_path.schedule is not None:
                cache_stats = fast_path.schedule.stats
                note = "; ".join(filter(None, [fast_path.notes.get("SDOptStepCache", str)(), eager]))
                short = "; ".join(filter(None, [cache_stats.shortfall(), eager_short]))
                record_in_run("SDOptStepCache", requested["SDOptStepCache"], f"{fast_path.step_cache_config.settings()}: {cache_stats.summary()}",
                              note, short)
            if "SDOptCUDAGraph" in requested and fast_path.graph_config:
                active = "CUDA graph: " + " | ".join(s.summary() for s in graph_stats)
                record_in_run("SDOptCUDAGraph", requested["SDOptCUDAGraph"], active, eager, eager_short)

    # SAMPLER_SAMPLE runs inside every OUTER_SAMPLE wrapper, so the profiler's run is open here
    entry = {"DIFFUSION_MODEL": fast_path} if fast_path.family.call.runs_wrappers else {"APPLY_MODEL": ForwardRouter(fast_path)}
    set_wrappers(model, FAST_PATH_KEY, {**entry, "SAMPLER_SAMPLE": report_after_sampling})


def fast_path_clone(model, node: str, requested: str, problem: Unavailable | None, on_unavailable: str, name: str, config):
    """(clone, note) for SDOptCompile, SDOptCUDAGraph and SDOptStepCache: the clone's fast path gets
    ``config`` at ``name``'s place in ``CHAIN`` (the rest of the chain as the input model had it). Where ``problem``
    says the technique cannot run, or where ComfyUI has no non-dynamic copy of a dynamic VRAM model for it:
    ``fall_back_or_raise``, then the clone as it is, recorded as eager, and a None note."""
    unavailable = fall_back_or_raise(on_unavailable, problem, "run eager")
    m, path_note, delegate_problem = (model.clone(), "", None) if unavailable else non_dynamic_clone(model)
    unavailable = unavailable or fall_back_or_raise(on_unavailable, delegate_problem, "run eager")
    if unavailable:
        trim_heap_after_sampling(m)
        record_model(m, node, requested, "eager", f"{unavailable}; running eager", f"runs eager: {unavailable}")
        return m, None
    current = fast_path_of(m)
    fast_path = current.with_config(name, config) if current else FastPath({name: config}, model_family(m))
    fast_path.requested[node] = requested
    install_fast_path(m, fast_path)
    return m, "; ".join(filter(None, [path_note, fast_path.family.unknown_note]))
