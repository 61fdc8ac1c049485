"""SDOptStepCache (MODEL → MODEL): DeepCache for UNets, First Block Cache for diffusion transformers.

deepcache: every ``interval`` model calls the whole UNet runs; the calls between run only its shallow
branch on the deep features the last full call kept (``optim.step_cache``), on the clone's fast path.
With SDOptCompile and SDOptCUDAGraph in the chain the full and the shallow call are each compiled and
captured once.

first_block: ComfyUI's ``dit`` block patches put ``FirstBlockCache`` around every block of the family's
``block_groups``; an APPLY_MODEL wrapper starts each model call (its cond/uncond key, its place in the
schedule, ControlNet inputs to run uncached). Regional compile runs beside it; whole-model compile and
CUDA graphs cannot hold a per-call decision between blocks and run eager, and their records say so.

The record gives the calls computed against reused; the checkpoints sdopt generates have random
weights, so an error measured on them says nothing about a trained model's images.
"""
import functools

from ..optim.step_cache import FIRST_BLOCK, MODES, CacheSchedule, FirstBlockCache, StepCacheConfig, full_forward, shallow_forward, unavailable
from . import call_rows, environment, fast_path, patching
from .base import PatchNode
from .inputs import on_unavailable_input
from .unet_blocks import comfy_unet_blocks

NODE = "SDOptStepCache"
QUALITY_NOTE = "reuses deep features between full calls: its image differs from the uncached one; measure it (bench speed's cache rungs)"
FIRST_BLOCK_QUALITY_NOTE = ("skips the blocks after the first where the first block's change moved less than the threshold: its "
                            "image differs from the uncached one; measure it (bench speed's cache rungs)")
FIRST_BLOCK_COMPOSES = "sdopt Compile runs beside it in compile_regional mode, whole-model compile and CUDA Graph run eager"
_APPLY_MODEL_INPUTS = ("x", "t", "c_concat", "c_crossattn", "control", "transformer_options")


def quality_note(config: StepCacheConfig) -> str:
    """What the record says of the image: that it differs from the uncached one, unless the settings reuse nothing."""
    if config.reuses_nothing:
        setting = f"interval {config.interval}" if config.mode != FIRST_BLOCK else f"threshold {config.threshold}"
        return f"{setting} reuses nothing: every call runs whole, so its image is the uncached one"
    return FIRST_BLOCK_QUALITY_NOTE if config.mode == FIRST_BLOCK else QUALITY_NOTE


FULL_STEP, SHALLOW_STEP = "full", "shallow"


def _cached_full_forward(options: dict, branch: int, unet, *tensors):
    """(output, deep features) of the whole UNet, for the step cache to keep."""
    return full_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors)


def _cached_shallow_forward(options: dict, branch: int, unet, *tensors_and_deep):
    """The UNet's output from its shallow branch and kept deep features (the last input)."""
    *tensors, deep = tensors_and_deep
    return shallow_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors, deep=deep)


class StepCacheMember(fast_path.ChainMember):
    """deepcache on the fast path: per call it picks the whole UNet (keeping its deep features) or its
    shallow branch on the kept ones, each a pure function of tensors, so compile and a CUDA graph
    outside it compile and capture each once."""

    node, place, selects_forward = NODE, 10, True

    def new_state(self, config):
        return CacheSchedule(config)

    def begin_run(self, state):
        state.reset()

    def end_run(self, state):
        state.release()

    def forward_of(self, kind, options, config):
        return functools.partial(_cached_full_forward if kind == FULL_STEP else _cached_shallow_forward, options, config.branch)

    def select(self, state, config, run, transformer_options, tensors):
        key = call_rows.call_key(transformer_options)
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)
        deep = state.decide(key, shapes, fast_path.schedule_position(transformer_options) if state.config.bounded else None)
        if deep is not None:
            return run(SHALLOW_STEP, (*tensors, deep))
        output, deep = run(FULL_STEP, tensors)
        state.keep(key, shapes, deep)
        return output

    def record(self, path, config, state, parts, eager):
        note = "; ".join(filter(None, [path.notes.get(NODE, str)(), eager.note]))
        short = "; ".join(filter(None, [state.stats.shortfall(), eager.short]))
        return f"{config.settings()}: {state.stats.summary()}", note, short


CHAIN_MEMBER = StepCacheMember()


class SDOptStepCache(PatchNode):
    DESCRIPTION = (
        "Reuses part of earlier model calls to skip work: deepcache for UNets (SD1.5, SDXL), first_block for "
        "diffusion transformers (SD3.5, Flux). The image changes: compare it with the uncached one, and with "
        "fewer steps."
    )

    @classmethod
    def inputs(cls):
        return {
            "mode": (list(MODES), {"default": MODES[0], "tooltip": "deepcache: UNets (SD1.5, SDXL). first_block: diffusion transformers (SD3.5, Flux)."}),
            "interval": ("INT", {"default": StepCacheConfig.interval, "min": 1, "max": 10, "tooltip": "deepcache: the whole UNet runs every this many model calls; 1 caches nothing."}),
            "branch": ("INT", {"default": 0, "min": 0, "max": 11, "tooltip": "deepcache: how many skip levels still run on a cached call, minus one: 0 runs only the outermost blocks (fastest)."}),
            "start": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": "Calls before this fraction of the schedule run the whole model."}),
            "end": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": "Calls from this fraction of the schedule on run the whole model."}),
            "on_unavailable": on_unavailable_input("On a model the mode does not fit: fallback returns it uncached with a note naming the mode that fits, error stops."),
        }

    @classmethod
    def optional_inputs(cls):
        return {
            "threshold": ("FLOAT", {"default": StepCacheConfig.threshold, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": (
                "first_block: the largest relative change of the first block's output that still skips the rest; "
                "higher is faster and further from uncached, 0 caches nothing.")}),
        }

    def patch(self, model, mode, interval, branch, start, end, on_unavailable, threshold=StepCacheConfig.threshold):
        config = StepCacheConfig(mode, interval, branch, start, end, threshold)
        requested = f"{config.settings()}, on_unavailable={on_unavailable}"
        unet = model.model.diffusion_model
        groups = block_groups(model)
        problem = unavailable(config, model.load_device, blocks=comfy_unet_blocks(unet), block_groups=groups)
        if mode == FIRST_BLOCK:
            return (_first_block_clone(model, config, requested, problem, on_unavailable, groups),)
        m, path_note = fast_path.fast_path_clone(model, CHAIN_MEMBER, requested, problem, on_unavailable, config)
        if path_note is not None:
            fast_path.fast_path_of(m).notes[NODE] = lambda: quality_note(config)
            patching.record_model(m, NODE, requested, config.settings(), "; ".join(filter(None, [path_note, quality_note(config)])))
        return (m,)


def block_groups(model) -> tuple[tuple[str, int], ...]:
    """(``dit`` patch name, block count) of each of the model's block groups its family describes."""
    unet = model.model.diffusion_model
    described = environment.model_family(model).described.block_groups
    return tuple((name, len(getattr(unet, attr))) for name, attr in described if hasattr(unet, attr))


def _dit_patches(model) -> dict:
    return model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})


def _without_first_block(model):
    """A clone of ``model`` without an earlier first_block cache (chained twice, the last node wins)."""
    m = model.clone()
    patching.set_wrappers(m, NODE, {})
    ours = [key for key, patch in _dit_patches(m).items() if fast_path.block_cache_of(patch) is not None]
    if ours:
        replace = m.model_options["transformer_options"]["patches_replace"]
        replace["dit"] = {key: patch for key, patch in replace["dit"].items() if key not in ours}
    return m


def _first_block_clone(model, config: StepCacheConfig, requested: str, problem, on_unavailable: str, groups):
    fallback = patching.fall_back_or_raise(on_unavailable, problem, "run uncached")
    m = _without_first_block(model)
    if fallback:
        patching.record_model(m, NODE, requested, "uncached", f"{fallback}; running uncached", f"runs uncached: {fallback}")
        return m
    cache = FirstBlockCache(config, groups, compared="img")
    first_block_note = f"{quality_note(config)}; {FIRST_BLOCK_COMPOSES}"
    earlier = _dit_patches(m)
    for name, count in groups:
        for index in range(count):
            m.set_model_patch_replace(_block_patch(cache, name, index, earlier.get((name, index))), "dit", name, index)

    def begin_call(executor, *args, **kwargs):
        inputs = {**dict(zip(_APPLY_MODEL_INPUTS, args)), **kwargs}
        options, x = inputs.get("transformer_options") or {}, inputs["x"]
        context = inputs.get("c_crossattn")
        shapes = (tuple(x.shape), x.dtype, None if context is None else tuple(context.shape))
        bypass = "ControlNet (control) inputs" if inputs.get("control") is not None else None
        cache.begin(call_rows.call_key(options), shapes, fast_path.schedule_position(options), bypass)
        try:
            return executor(*args, **kwargs)
        finally:
            cache.finish()

    def record_after_sampling(executor, *args, **kwargs):
        cache.reset()
        try:
            return executor(*args, **kwargs)
        finally:
            patching.record_in_run(NODE, requested, f"{config.settings()}: {cache.stats.summary()}", first_block_note,
                               cache.stats.shortfall())
            cache.release()

    # SAMPLER_SAMPLE runs inside every OUTER_SAMPLE wrapper, so the profiler's run is open there
    patching.set_wrappers(m, NODE, {"APPLY_MODEL": begin_call, "SAMPLER_SAMPLE": record_after_sampling})
    blocks = ", ".join(f"{count} {name}s" for name, count in groups)
    patching.record_model(m, NODE, requested, config.settings(), f"{blocks}; {first_block_note}")
    return m


def _block_patch(cache: FirstBlockCache, name: str, index: int, earlier):
    """ComfyUI's ``dit`` block patch for block ``index`` of group ``name``: the cache around the block
    (around ``earlier``, a patch another node put there, unless it is an earlier sdopt cache's)."""
    if fast_path.block_cache_of(earlier) is not None:
        earlier = None

    def patch(args, extra):
        run = (lambda: earlier(args, extra)) if earlier is not None else (lambda: extra["original_block"](args))
        return cache.block(name, index, args, run)

    setattr(patch, fast_path.BLOCK_CACHE_ATTRIBUTE, cache)
    return patch
