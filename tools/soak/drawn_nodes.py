"""The sdopt nodes a soak prompt draws, and their random settings.

The registry (``nodes/registry.py``) is the one list of the pack's nodes: every registered node that
takes a MODEL or a VAE and returns it is drawn on that path, its settings drawn by the function that
``SETTINGS`` holds under its class name. ``SETTINGS``'s order is the order of the draws, so it fixes
each seed's prompts. A registered node that patches a MODEL or a VAE and has no settings here stops the
soak before it starts, with the node's name, and so does any other registered node unless it has a place
of its own (sdopt Profile Report, on the decoded image) or ``NOT_SOAKED`` says why it is left out. The
Profiler goes last on the MODEL path, where its tooltip says it belongs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ...optim.compile import MODES as COMPILE_MODES

PROFILER = "SDOptProfiler"
REPORT = "SDOptProfileReport"


def _precision(rng: random.Random) -> dict:
    return {"weight_dtype": rng.choice(("auto", "default", "fp32", "bf16", "fp16", "fp8_e4m3fn")),
            "compute_dtype": rng.choice(("default", "fp32", "bf16")), "tf32": rng.random() < 0.5,
            "channels_last": rng.random() < 0.5}


def _attention(rng: random.Random) -> dict:
    return {"backend": rng.choice(("auto", "low_memory", "sdpa", "sdpa_fused", "sliced", "sub_quadratic", "naive", "xformers")),
            "on_unavailable": "fallback", "slice_size": rng.choice((0, 0, 256)), "memory_budget_mb": rng.choice((1, 32))}


def _low_memory(rng: random.Random) -> dict:
    return {"budget_mb": rng.choice((1, 16, 256)), "sequential_cfg": rng.random() < 0.5, "chunk_ops": rng.random() < 0.5}


def _offload(rng: random.Random) -> dict:
    return {"mode": rng.choice(("none", "budget", "sequential", "unload_after")), "budget_mb": rng.choice((0, 64, 1024)),
            "on_unavailable": "fallback"}


COMPILE = "SDOptCompile"
# The first warm-up prompts run Compile in each of its modes, so that torch's one-time set-up of dynamo
# and of TorchScript (75-80 MiB each, docs/benchmarks-log.md), and that of regional compile's dynamic
# shapes, lands in the warm-up, not in the drift.
COMPILE_MODES_FIRST = COMPILE_MODES


def _compile(rng: random.Random) -> dict:
    return {"mode": rng.choice(("compile",) + COMPILE_MODES), "backend": rng.choice(("aot_eager", "eager")),
            "compile_mode": "default", "dynamic": False, "fullgraph": False, "on_unavailable": "fallback"}


def _cuda_graph(rng: random.Random) -> dict:
    return {"max_graphs": rng.choice((1, 4)), "on_unavailable": "fallback"}


def _step_cache(rng: random.Random) -> dict:
    # Either mode on any family: the mode that does not fit the model must pass it through with a note.
    return {"mode": rng.choice(("deepcache", "first_block")), "interval": rng.choice((1, 2, 3)), "branch": rng.choice((0, 1)),
            "start": rng.choice((0.0, 0.2)), "end": rng.choice((0.8, 1.0)), "on_unavailable": "fallback",
            "threshold": rng.choice((0.0, 0.08, 0.5))}


def _profiler(rng: random.Random) -> dict:
    return {"label": rng.choice(("soak", "fast path"))}


def _vae_precision(rng: random.Random) -> dict:
    # No explicit bf16: on a CPU without bf16 convolutions one 64 px decode takes over a minute in it; auto
    # still picks bf16 where it measured faster.
    return {"dtype": rng.choice(("auto", "default", "fp32")), "nan_guard": rng.random() < 0.5}


def _tiled_vae(rng: random.Random) -> dict:
    tile = rng.choice((0, 64, 96))
    return {"tile": tile, "overlap": rng.choice((0, 16)) if tile else 0, "only_when_needed": rng.random() < 0.5,
            "budget_mb": rng.choice((0, 64))}


# Each drawn node's random settings by class name, in the order of the draws: the MODEL path's nodes
# (shuffled in each prompt), the Profiler (last on the MODEL path), the VAE path's nodes.
SETTINGS: dict[str, Callable[[random.Random], dict]] = {
    "SDOptPrecision": _precision, "SDOptAttention": _attention, "SDOptLowMemory": _low_memory,
    "SDOptOffload": _offload, COMPILE: _compile, "SDOptCUDAGraph": _cuda_graph, "SDOptStepCache": _step_cache,
    PROFILER: _profiler,
    "SDOptVAEPrecision": _vae_precision, "SDOptVAEAttention": _attention, "SDOptTiledVAE": _tiled_vae,
}
# Registered nodes that patch neither a MODEL nor a VAE: the one a prompt places on the decoded image,
# and those it leaves out, each with the reason.
ON_THE_IMAGE = REPORT
NOT_SOAKED = {"SDOptDoctor": "it runs the whole doctor check list, not a patch",
              "SDOptAuto": "it applies the single nodes the soak draws, chosen per run; its host test holds it"}
PATHS = ("MODEL", "VAE")


@dataclass(frozen=True)
class SoakNodes:
    """The registered nodes a soak draws, in the order of the draws: the MODEL path's (shuffled in each
    prompt, the Profiler then last) and the VAE path's."""

    model: tuple[str, ...]
    vae: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        """Every node a soak uses, in the order the groups of consecutive prompts force them in."""
        return (*self.model, PROFILER, *self.vae, REPORT)


def patched_path(node_class) -> str | None:
    """``MODEL`` or ``VAE`` where the node takes one and returns it as its only output, else None."""
    required = node_class.INPUT_TYPES().get("required", {})
    returns = tuple(getattr(node_class, "RETURN_TYPES", ()))
    return next((kind for kind in PATHS if returns == (kind,) and any(spec[0] == kind for spec in required.values())), None)


def soak_nodes(registry: dict | None = None) -> SoakNodes:
    """The nodes of ``registry`` (default: the pack's, ``NODE_CLASS_MAPPINGS``) a soak draws. A registered
    node the soak neither draws, places nor leaves out with a reason, and settings for a node that is not
    registered, raise ``RuntimeError`` naming the node: the soak must cover the pack's nodes as registered."""
    if registry is None:
        from ...nodes.registry import NODE_CLASS_MAPPINGS as registry
    paths = {name: patched_path(node_class) for name, node_class in registry.items()}
    for name, path in paths.items():
        if path is not None and name not in SETTINGS:
            raise RuntimeError(f"soak: the registered node {name} takes and returns a {path}, and the soak has no random "
                               f"settings for it: add a function that draws its inputs to SETTINGS in {__name__}, or "
                               "leave it out in NOT_SOAKED with the reason")
        if path is None and name != ON_THE_IMAGE and name not in NOT_SOAKED:
            raise RuntimeError(f"soak: the registered node {name} patches no MODEL or VAE, and the soak neither places it "
                               f"nor says why it leaves it out: list it in NOT_SOAKED in {__name__} with the reason")
    for name in (*SETTINGS, ON_THE_IMAGE):
        if name not in registry:
            raise RuntimeError(f"soak: it draws {name}, which nodes/registry.py does not register: take it out of {__name__}")
    if paths[PROFILER] != "MODEL":
        raise RuntimeError(f"soak: {PROFILER} goes last on the MODEL path, and it no longer takes and returns a MODEL")
    drawn = [name for name in SETTINGS if name != PROFILER]
    return SoakNodes(model=tuple(name for name in drawn if paths[name] == "MODEL"),
                     vae=tuple(name for name in drawn if paths[name] == "VAE"))
