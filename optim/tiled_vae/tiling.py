"""The tiled VAE's verbs: pick a tile that fits the budget, run untiled when asked and it fits,
retry smaller tiles on out-of-memory, and say what was done."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..device import free_memory
from ..precision import dtype_name
from .adapters import layout_of
from .config import DECODE, ENCODE, TiledResult, TiledVAEConfig, TilingStats, UnsupportedVAE
from .execution import Run, schedule, untiled_estimate


def _candidates(latent: tuple[int, int], factor: int, min_tile: int) -> list[int]:
    """Tile sides (latent pixels) from the whole input down to ``min_tile``, one per distinct grid."""
    longest, smallest = max(latent), max(1, -(-min_tile // factor))
    sides, n = [], 1
    while True:
        side = -(-longest // n)
        if side < smallest:
            break
        if not sides or side < sides[-1]:
            sides.append(side)
        n += 1
    return sides or [smallest]


def _tiled(model: nn.Module, x: torch.Tensor, kind: str, config: TiledVAEConfig,
           progress: Callable[[int, int], None] | None, architecture: str | None) -> TiledResult:
    if x.ndim != 4:
        raise UnsupportedVAE(f"a {x.ndim - 2}D input (images only)")
    layout = layout_of(model, kind, x.shape[1], architecture)
    graph, factor = layout.graph, layout.factor
    if kind == ENCODE and (x.shape[2] % factor or x.shape[3] % factor):
        raise UnsupportedVAE(f"an image whose sides {tuple(x.shape[2:])} are not multiples of {factor}")
    budget = config.budget_bytes if config.budget_bytes is not None else (config.free_bytes or free_memory)(x.device)
    untiled = untiled_estimate(graph, x.shape, x.dtype)
    tried, retries = [], 0
    if config.only_when_needed and untiled <= budget:
        try:
            with torch.no_grad():
                out = layout.untiled(x)
            return TiledResult(out, TilingStats(False, budget_bytes=budget, untiled_estimate_bytes=untiled,
                                                reason=f"fits: {untiled / 2**20:,.0f} MiB estimated ≤ {budget / 2**20:,.0f} MiB budget"))
        except torch.OutOfMemoryError:
            tried, retries = [max(x.shape[2:]) * (factor if kind == DECODE else 1)], 1
        if x.device.type == "cuda":
            torch.cuda.empty_cache()
    latent = (x.shape[2] // graph.input.scale, x.shape[3] // graph.input.scale)
    overlap = config.overlap if kind == DECODE else config.overlap // factor
    schedules = {keep: schedule(graph, keep) for keep in (True, False)}

    def run_for(side: int, keep: bool) -> Run:
        return Run(graph, schedules[keep], x.shape, side, overlap, x.dtype, config.store_dtype, x.device)

    sides = [max(1, config.tile // factor)] if config.tile else _candidates(latent, factor, config.min_tile)
    sides = [s for s in sides if s * factor > config.overlap] or [max(sides[-1], config.overlap // factor + 1)]
    keeps = [config.keep_intermediates] if config.keep_intermediates is not None else [True, False]
    choice, reason = None, ""
    for keep in keeps:
        choice = next(((s, keep) for s in sides if run_for(s, keep).estimate() <= budget), None)
        if choice:
            break
    if choice is None:
        choice = (sides[-1], keeps[-1])
        reason = f"the budget ({budget / 2**20:,.0f} MiB) is below the estimate even at the smallest tile"
    side, keep = choice
    smallest = max(1, -(-config.min_tile // factor))
    while True:
        run = run_for(side, keep)
        tried.append(side * factor)
        try:
            with torch.no_grad():
                out = run.execute(x, progress)
            break
        except torch.OutOfMemoryError:
            if side <= smallest and not keep:
                raise
        retries += 1
        del run
        if x.device.type == "cuda":
            torch.cuda.empty_cache()
        side, keep = (max(smallest, side // 2), keep) if side > smallest else (side, False)
    stats = TilingStats(
        True, tile=side * factor, grid=run.grid.shape, passes=run.passes, oom_retries=retries, tiles_tried=tuple(tried),
        kept_intermediates=keep, budget_bytes=budget, estimated_peak_bytes=run.estimate(), untiled_estimate_bytes=untiled,
        store_dtype=dtype_name(run.store_dtype) if run.store_dtype != x.dtype else None, stored=run.stored,
        stored_wide=run.stored_wide, compute_dtype=dtype_name(x.dtype), reason=reason, last_resort=side <= smallest and not keep)
    return TiledResult(out, stats)


def tiled_decode(model: nn.Module, latent: torch.Tensor, config: TiledVAEConfig = TiledVAEConfig(),
                 progress: Callable[[int, int], None] | None = None, architecture: str | None = None) -> TiledResult:
    """Decode ``latent`` (in the model's dtype and device) tile by tile with whole-image GroupNorm.

    ``model``: the autoencoder (``post_quant_conv`` and ``decoder``). ``progress(done, total)`` is
    called after every tile of every pass. Raises ``UnsupportedVAE`` for modules it does not know,
    and ``torch.OutOfMemoryError`` only when the smallest tile still does not fit. ``architecture``
    (a ``Family.vae_layout``) limits the adapters to that VAE architecture's; None: any that
    recognizes the module.
    """
    return _tiled(model, latent, DECODE, config, progress, architecture)


def tiled_encode(model: nn.Module, pixels: torch.Tensor, config: TiledVAEConfig = TiledVAEConfig(),
                 progress: Callable[[int, int], None] | None = None, architecture: str | None = None) -> TiledResult:
    """Encode ``pixels`` (NCHW in [-1, 1], sides multiples of 8) tile by tile into the posterior's
    mode, as the untiled ``encode`` of ComfyUI's VAE returns it."""
    return _tiled(model, pixels, ENCODE, config, progress, architecture)


def unsupported_reason(model: nn.Module, kind: str = DECODE, architecture: str | None = None) -> str | None:
    """Why ``model``'s ``kind`` (decode or encode) cannot be tiled here, or None when it can."""
    try:
        layout_of(model, kind, 1, architecture)
    except UnsupportedVAE as error:
        return str(error)
    return None
