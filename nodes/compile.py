"""SDOptCompile (MODEL → MODEL): the UNet through torch.compile, regional compile or a trace.

The node only configures the clone's fast path (``fast_path.FastPath``); each input shape's first
call runs eagerly and its second compiles (usually sampling step 1), and the profiler report gives
its count, time, guard-failure reasons, graph breaks and the functions torch gave up on. Where
ComfyUI's own attention breaks torch.compile's graph (on a CPU it asks psutil for free memory on
every call) and no attention override is set, the node runs attention through sdopt's sdpa itself
on the calls the fast path serves, so that the UNet compiles as one graph, and a trace freezes nothing
computed from the moment's free memory (a call the fast path leaves eager keeps ComfyUI's attention);
an sdopt Attention node before or after it chooses the backend instead.
"""
import dataclasses
import functools
from collections.abc import Callable

import torch

from ..families import Family
from ..optim.attention import AttentionConfig, build_attention
from ..optim.compile import (BACKENDS, COMPILE_MODES, MODE_OBJECTS, MODES, ArtifactCache, CompileConfig, compile_forward, graph_break_reasons,
                             nchw_conv_weight_bytes, unavailable)
from . import environment, fast_path, patching
from .attention import OVERRIDE_KEY, POSITION_BLIND, comfy_attention_override
from .base import PatchNode
from .inputs import on_unavailable_input

NODE = "SDOptCompile"
# Below this, inductor's per-step copy of NCHW conv weights costs microseconds: not worth a note.
NCHW_NOTE_MIN_BYTES = 2**20
# The probe's attention call: small, and a head size every attention kernel takes.
PROBE_TOKENS, PROBE_HEADS, PROBE_HEAD_DIM = 64, 2, 64
ROUTE_MARK = "sdopt_compile_route"  # on the override Compile set: its (note, call count)


@functools.lru_cache(maxsize=None)
def host_attention_breaks(attention, device: str, dtype: torch.dtype) -> tuple[str, ...]:
    """Why torch.compile cannot trace ComfyUI's ``attention`` on ``device`` in ``dtype`` as one
    graph (its graph-break reasons); () where it can. Once per function, device and dtype."""
    q = torch.randn(1, PROBE_TOKENS, PROBE_HEADS * PROBE_HEAD_DIM, device=device, dtype=dtype)
    try:
        return tuple(graph_break_reasons(attention, q, q, q, PROBE_HEADS, transformer_options={}))
    except Exception as error:  # what cannot even run in a probe cannot run compiled either
        return (f"it failed in a trial call ({type(error).__name__}: {error})",)


def route_attention(m, config: CompileConfig) -> tuple[str, dict]:
    """Where ComfyUI's attention breaks the graph and ``m`` has no attention override: sdopt's sdpa
    set as ``m``'s override; (the note that says so, the override's call count), else ("", {})."""
    try:
        attention = environment.comfy_attention()
    except ImportError:  # a host without ComfyUI's attention module: nothing of its to route
        return "", {}
    options = m.model_options.get("transformer_options", {})
    earlier = getattr(options.get(OVERRIDE_KEY), ROUTE_MARK, None)
    if earlier is not None:  # an earlier Compile node's route, still in force
        return earlier
    if OVERRIDE_KEY in options or not hasattr(attention, "wrap_attn"):
        return "", {}
    host = attention.optimized_attention
    dtype = getattr(m.model, "manual_cast_dtype", None) or m.model_dtype()
    reasons = host_attention_breaks(host, str(torch.device(m.load_device)), dtype)
    if not reasons:
        return "", {}
    calls = {"eager": 0}

    def count(delegated=False):
        if not torch.compiler.is_compiling():  # counted on the eager first call of each input signature
            calls["eager"] += 1

    name = getattr(host, "__name__", "attention function")
    note = (f"attention routed through sdopt's sdpa: ComfyUI's {name} {config.kind.host_attention_cost} ({reasons[0]}); "
            "an sdopt Attention node before or after Compile picks another backend")
    override = comfy_attention_override(build_attention(AttentionConfig(backend="sdpa")), count)
    setattr(override, ROUTE_MARK, (note, calls))
    setattr(override, fast_path.CHAIN_ONLY_ATTRIBUTE, True)  # a call the chain cannot serve keeps ComfyUI's attention
    transformer_options = dict(options)
    transformer_options[OVERRIDE_KEY] = override
    m.model_options["transformer_options"] = transformer_options
    return note, calls


def _without(keys: frozenset, options: dict) -> dict:
    return options if keys.isdisjoint(options) else {name: value for name, value in options.items() if name not in keys}


def positionless_block_options(family: Family | None, options: dict) -> Callable[[dict], dict] | None:
    """What regional compile hands each block for its options: ComfyUI's without the keys that say
    the block's place (``Family.block_position_options``), where nothing in the call reads them: no
    patch keyed by place, and no attention override but sdopt's. None (as ComfyUI gives them) elsewhere,
    and for a model of a family sdopt does not know, whose blocks may read them."""
    keys = frozenset(family.block_position_options if family is not None else ())
    override = options.get(OVERRIDE_KEY)
    if not keys or options.get("patches_replace") or (override is not None and not getattr(override, POSITION_BLIND, False)):
        return None
    return functools.partial(_without, keys)


class CompileState:
    """What Compile keeps per fast path: the bytes of NCHW conv weights inductor copies per step, and
    what the last save of sdopt's compile cache said."""

    def __init__(self):
        self.nchw_conv_bytes, self.cache_saved = 0, None


class CompileMember(fast_path.ChainMember):
    """Compile on the fast path: it compiles the forward it is given (the step cache's pick), so a
    CUDA graph outside it replays compiled kernels."""

    node, place, speed_only = NODE, 20, True

    def new_state(self, config):
        return CompileState()

    def keeps_forward_code(self, config) -> bool:
        return config.kind.compiles_blocks_only

    def wrap(self, path, unet, fn, call, config, options):
        if config.kind.compiles_blocks_only:
            config = dataclasses.replace(config, block_options=positionless_block_options(path.family.family, options))
        compiled = compile_forward(unet, call, config)
        path.states[self].nchw_conv_bytes = nchw_conv_weight_bytes(unet, config)
        if not config.kind.uses_compile_cache:
            return compiled, compiled, None
        cache = ArtifactCache.for_module(unet, config, path.cache_root)
        cache.load()
        return cache.wrap(compiled), compiled, cache  # every call, recompiles too, with torch's compiler caches in sdopt's entry

    def warmup(self, part):
        return fast_path.Warmup("compile", part.stats.compilations, part.stats.compile_seconds)

    def warmed_up(self, state, part, cache):
        if cache is not None:
            state.cache_saved = cache.save()

    def record(self, path, config, state, parts, eager):
        stats = [part.stats for part in parts]
        caches = (cache for *_, cache in path.runners.values() if cache)
        warm = "; ".join(dict.fromkeys(filter(None, (cache.note() for cache in caches))))
        layout = (
            f"{state.nchw_conv_bytes / 2**20:,.0f} MiB of conv weights are stored NCHW, so inductor copies them to "
            "channels-last on every step: sdopt Precision's channels_last stores them that way once"
        ) if state.nchw_conv_bytes >= NCHW_NOTE_MIN_BYTES else ""
        details = [line for s in stats for line in s.details()]
        note = "; ".join(filter(None, [path.notes.get(NODE, str)(), *details, warm,
                                       f"cache: {state.cache_saved}" if state.cache_saved else "", layout, eager.note]))
        active = f"{config.settings()}: " + (" | ".join(s.summary() for s in stats) or "no call ran compiled")
        short = "; ".join(dict.fromkeys(filter(None, [*(s.shortfall() for s in stats), eager.short])))
        return active, note, short


CHAIN_MEMBER = CompileMember()


class SDOptCompile(PatchNode):
    DESCRIPTION = (
        "Compiles the diffusion model on its first steps (torch.compile, per block class, or a trace); later "
        "steps at the same size run faster. LoRA and weight changes need no recompile. Put sdopt CUDA Graph after "
        "it."
    )

    @classmethod
    def inputs(cls):
        return {
            "mode": (list(MODES), {"default": "compile", "tooltip": "compile: the whole model. compile_regional: each repeated block class once, shorter where blocks share a shape (DiTs). trace: torch.jit.trace per resolution."}),
            "backend": (list(BACKENDS), {"default": "inductor", "tooltip": "torch.compile backend (compile modes only)."}),
            "compile_mode": (list(COMPILE_MODES), {"default": "default", "tooltip": "inductor mode. Prefer default or max-autotune-no-cudagraphs with sdopt CUDA Graph: reduce-overhead makes its own graphs."}),
            "dynamic": ("BOOLEAN", {"default": False, "tooltip": "Dynamic shapes: one compile for all resolutions, slower code."}),
            "fullgraph": ("BOOLEAN", {"default": False, "tooltip": "Fail on a graph break instead of splitting the graph."}),
            "on_unavailable": on_unavailable_input("Where it cannot compile (no Triton or C++ compiler; dynamic VRAM without a non-dynamic copy): fallback runs eager with a note, error stops."),
        }

    def patch(self, model, mode, backend, compile_mode, dynamic, fullgraph, on_unavailable):
        kind = MODE_OBJECTS[mode]
        # only a mode that compiles blocks needs the model's family to say which
        blocks = kind.block_classes(environment.model_family(model).described.repeated_blocks) if kind.compiles_blocks_only else ()
        config = CompileConfig(mode, backend, compile_mode, dynamic, fullgraph, block_classes=blocks)
        requested = f"{config.settings()}, on_unavailable={on_unavailable}"
        m, path_note = fast_path.fast_path_clone(model, CHAIN_MEMBER, requested, unavailable(config, model.load_device), on_unavailable, config)
        if path_note is not None:
            routed, calls = route_attention(m, config)
            fast_path.fast_path_of(m).notes[NODE] = lambda: routed if calls.get("eager") else ""
            patching.record_model(m, NODE, requested, config.settings(), "; ".join(filter(None, [path_note, config.kind.setup_note, routed])))
        return (m,)
