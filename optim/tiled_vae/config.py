"""The tiled VAE's settings, their validation, and what one tiled call did."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import UserError

DECODE = "decode"
ENCODE = "encode"
MIN_TILE = 64
TILE_STEP = 8


class UnsupportedVAE(ValueError):
    """The module is not a VAE this tiler knows; the message says what is missing."""


def check_tile_inputs(tile: int | None, overlap: int) -> str | None:
    """The one-line problem with these settings (naming the input), or None when they are valid.

    ``tile``: None or 0 is auto, else image pixels, a multiple of 8 and at least 64.
    ``overlap``: image pixels, a multiple of 8, smaller than ``tile``.
    """
    return check_tile(tile) or check_overlap(overlap, tile)


def check_tile(tile: int | None) -> str | None:
    """The problem with ``tile`` alone, or None."""
    if tile:
        if tile < MIN_TILE:
            return f"tile: {tile} px is under the {MIN_TILE} px minimum; use {MIN_TILE} or more, or 0 for auto"
        if tile % TILE_STEP:
            lower, upper = tile // TILE_STEP * TILE_STEP, (tile // TILE_STEP + 1) * TILE_STEP
            return f"tile: {tile} px is not a multiple of 8; use {max(lower, MIN_TILE)} or {upper}, or 0 for auto"
    return None


def check_overlap(overlap: int, tile: int | None) -> str | None:
    """The problem with ``overlap`` (alone, and against a valid ``tile``), or None."""
    if overlap < 0 or overlap % TILE_STEP:
        return f"overlap: {overlap} px must be 0 or a positive multiple of 8"
    if tile and overlap >= tile:
        return f"overlap: {overlap} px must be smaller than tile ({tile} px); lower overlap or raise tile"
    return None


@dataclass(frozen=True)
class TiledVAEConfig:
    """How to tile.

    ``tile``: side of a tile in image pixels (decode output, encode input); None = auto, the
    largest that fits ``budget_bytes``. ``overlap``: image pixels cross-faded between neighbouring
    final tiles (cores are exact without it). ``budget_bytes``: None = what ``free_bytes`` says the
    device can still allocate when the call runs (default ``free_memory``; a host passes its own view,
    e.g. ComfyUI's, less the VRAM it reserves).
    ``only_when_needed``: run the module untiled when its untiled peak is estimated to fit.
    ``store_dtype``: dtype of what is kept between passes when narrower than the compute dtype
    (None: the compute dtype); a tile's value past its range is kept in the compute dtype instead.
    ``keep_intermediates``: also keep each residual block's inner activations instead of
    recomputing them (faster, more memory); None = when it fits the budget. ``min_tile``: the
    smallest tile that out-of-memory retries go down to.
    """

    tile: int | None = None
    overlap: int = 0
    budget_bytes: int | None = None
    only_when_needed: bool = False
    store_dtype: torch.dtype | None = torch.float16
    keep_intermediates: bool | None = None
    min_tile: int = MIN_TILE
    free_bytes: Callable[[torch.device], int] | None = None

    def __post_init__(self):
        problem = check_tile_inputs(self.tile, self.overlap)
        if problem is None and self.budget_bytes is not None and self.budget_bytes <= 0:
            problem = f"budget_bytes: {self.budget_bytes} must be positive, or None for the free memory"
        if problem is None and (self.min_tile < MIN_TILE or self.min_tile % TILE_STEP):
            problem = f"min_tile: {self.min_tile} px must be a multiple of 8 and at least {MIN_TILE}"
        if problem:
            raise UserError(problem)


@dataclass(frozen=True)
class TilingStats:
    """What one tiled call did. Sizes are image pixels; bytes are the live-memory model's estimate.

    ``stored``: tile values kept between passes; ``stored_wide``: those kept in the compute dtype
    because they passed ``store_dtype``'s range (``store_dtype`` names the narrow one, None when
    values were kept in the compute dtype anyway). ``last_resort``: the tile was the smallest, with
    intermediates recomputed, so an out-of-memory error there has nothing smaller to retry."""

    tiled: bool
    tile: int | None = None
    grid: tuple[int, int] = (1, 1)
    passes: int = 0
    oom_retries: int = 0
    tiles_tried: tuple[int, ...] = ()
    kept_intermediates: bool = False
    budget_bytes: int = 0
    estimated_peak_bytes: int = 0
    untiled_estimate_bytes: int = 0
    store_dtype: str | None = None
    stored: int = 0
    stored_wide: int = 0
    compute_dtype: str = ""
    reason: str = ""
    last_resort: bool = False

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]

    def describe(self) -> str:
        if not self.tiled:
            return f"untiled ({self.reason})" if self.reason else "untiled"
        text = f"tiled {self.tile} px, {self.grid[0]}x{self.grid[1]} = {self.tiles} tiles, {self.passes} passes, "
        text += "kept intermediates" if self.kept_intermediates else "recomputed intermediates"
        if self.oom_retries:
            tried = " → ".join(str(t) for t in self.tiles_tried)
            text += f", {self.oom_retries} OOM retries (tile {tried} px)"
        else:
            text += ", 0 OOM retries"
        if self.stored_wide:
            text += (f", {self.stored_wide} of {self.stored} stored tile values past {self.store_dtype}'s range "
                     f"kept in {self.compute_dtype}")
        return f"{text}; {self.reason}" if self.reason else text


@dataclass(frozen=True)
class TiledResult:
    output: torch.Tensor
    stats: TilingStats
