"""Step caching for UNets (DeepCache): every ``interval`` model calls the whole UNet runs and the deep
features entering its last up-blocks are kept; the calls between run only the shallow branch (the
first ``branch + 1`` down-blocks and the last ``branch + 1`` up-blocks) on those kept features.

The UNet is seen through ``UNetBlocks`` (its embedding, down, middle, up blocks and output head), so
the technique knows no host. ``full_forward`` and ``shallow_forward`` are pure functions of tensors,
so each can be compiled and captured in a CUDA graph of its own. ``CacheSchedule`` decides, per model
call, which one runs: it counts calls, not sampler steps, per key (input shapes and the batch's
cond/uncond layout), so second-order samplers and sequential CFG each keep their own features.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

import torch

from ..errors import Unavailable, UserError

DEEPCACHE = "deepcache"
MODES = (DEEPCACHE,)


@dataclass(frozen=True)
class StepCacheConfig:
    """``interval``: a full UNet every this many calls (1 caches nothing); ``branch``: the skip
    level whose blocks still run on a cached call (0: only the outermost); ``start``/``end``: the
    part of the schedule (fractions of the sampling steps) where calls may reuse features."""

    mode: str = DEEPCACHE
    interval: int = 3
    branch: int = 0
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self):
        problem = None
        if self.mode not in MODES:
            problem = f"mode: {self.mode!r} is not one of {', '.join(MODES)}"
        elif self.interval < 1:
            problem = f"interval: {self.interval} must be at least 1 (1 runs the whole UNet on every call)"
        elif self.branch < 0:
            problem = f"branch: {self.branch} must be 0 or more"
        elif not 0.0 <= self.start < self.end <= 1.0:
            problem = f"start {self.start} and end {self.end}: need 0 <= start < end <= 1 (fractions of the schedule)"
        if problem:
            raise UserError(problem)

    @property
    def bounded(self) -> bool:
        """Whether the schedule's position matters (a start or end other than the whole run)."""
        return self.start > 0.0 or self.end < 1.0

    def settings(self) -> str:
        span = f", steps {self.start:.0%}–{self.end:.0%}" if self.bounded else ""
        return f"{self.mode}: interval {self.interval}, branch {self.branch}{span}"


def unavailable(config: StepCacheConfig, device: torch.device | None, *, blocks: "UNetBlocks | None") -> Unavailable | None:
    """Why the cache cannot run on this model, with the fix, else None. Any device serves; what
    decides is the model's layout, ``blocks`` (None where it is not a UNet)."""
    if blocks is None:
        return Unavailable("the model is not a UNet with down, middle and up blocks (DeepCache needs its skip connections)",
                           "leave sdopt Step Cache out for this model", "mode")
    if config.branch >= blocks.depth:
        return Unavailable(f"branch {config.branch} is past the UNet's {blocks.depth} skip levels",
                           f"choose a branch below {blocks.depth}", "branch")
    return None


class UNetBlocks(Protocol):
    """A UNet as DeepCache splits it. ``depth``: its number of down blocks (as many up blocks)."""

    depth: int

    def embed(self, x: torch.Tensor, timesteps: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor: ...

    def down(self, index: int, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor) -> torch.Tensor: ...

    def middle(self, h: torch.Tensor, emb: torch.Tensor, context: torch.Tensor) -> torch.Tensor: ...

    def up(self, index: int, h: torch.Tensor, skip: torch.Tensor, emb: torch.Tensor, context: torch.Tensor,
           output_shape: torch.Size | None) -> torch.Tensor: ...

    def head(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


def _up_from(blocks: UNetBlocks, first: int, h, skips: list, emb, context):
    for index in range(first, blocks.depth):
        skip = skips.pop()
        h = blocks.up(index, h, skip, emb, context, skips[-1].shape if skips else None)
    return h


def full_forward(blocks: UNetBlocks, branch: int, x, timesteps, context, y=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the UNet's output, the deep features that enter up-block ``depth - 1 - branch``)."""
    emb = blocks.embed(x, timesteps, y)
    skips, h = [], x
    for index in range(blocks.depth):
        h = blocks.down(index, h, emb, context)
        skips.append(h)
    h = blocks.middle(h, emb, context)
    last_deep = blocks.depth - 1 - branch
    for index in range(last_deep):
        skip = skips.pop()
        h = blocks.up(index, h, skip, emb, context, skips[-1].shape if skips else None)
    deep = h
    return blocks.head(_up_from(blocks, last_deep, h, skips, emb, context), x), deep


def shallow_forward(blocks: UNetBlocks, branch: int, x, timesteps, context, y=None, deep=None) -> torch.Tensor:
    """The UNet's output from its first ``branch + 1`` down blocks and ``deep`` (a full call's)."""
    emb = blocks.embed(x, timesteps, y)
    skips, h = [], x
    for index in range(branch + 1):
        h = blocks.down(index, h, emb, context)
        skips.append(h)
    return blocks.head(_up_from(blocks, blocks.depth - 1 - branch, deep, skips, emb, context), x)


@dataclass
class StepCacheStats:
    """One sampling run's calls."""

    full_calls: int = 0
    reused_calls: int = 0
    full_reasons: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        calls = self.full_calls + self.reused_calls
        if not calls:
            return "no model calls yet"
        return f"{self.full_calls} of {calls} calls ran the whole UNet, {self.reused_calls} reused deep features"

    def shortfall(self) -> str:
        """What the cache did less than asked, or ''."""
        if self.full_calls and not self.reused_calls:
            return "reused nothing: " + ", ".join(f"{reason} ({n}x)" for reason, n in self.full_reasons.items())
        return ""


FIRST_CALL, INTERVAL_DUE, OUTSIDE_SPAN, NEW_SHAPE = (
    "first call of its shapes in this run", "interval due", "outside the cached part of the schedule", "new input shapes")


class CacheSchedule:
    """Which model calls reuse deep features, and the features kept per key.

    ``decide(key, shapes, position)`` returns the features a call may reuse, or None when it must run
    the whole UNet (then ``keep(key, features)`` stores what it made). ``position`` is the fraction
    of the schedule done (needed only where the config is ``bounded``). ``reset()`` starts a new
    sampling run: nothing carries over from one run to the next, so changed weights (a LoRA's new
    strength) are always seen; ``stats`` are the current run's.
    """

    def __init__(self, config: StepCacheConfig):
        self.config = config
        self.stats = StepCacheStats()
        self._kept: dict[Hashable, tuple[Any, torch.Tensor]] = {}
        self._since_full: dict[Hashable, int] = {}

    def reset(self) -> None:
        self._kept.clear()
        self._since_full.clear()
        self.stats = StepCacheStats()

    def _full(self, reason: str):
        self.stats.full_calls += 1
        self.stats.full_reasons[reason] += 1
        return None

    def decide(self, key: Hashable, shapes: Any, position: float | None = None) -> torch.Tensor | None:
        if self.config.bounded and (position is None or not self.config.start <= position < self.config.end):
            return self._full(OUTSIDE_SPAN)
        kept = self._kept.get(key)
        if kept is None:
            return self._full(FIRST_CALL)
        if kept[0] != shapes:
            return self._full(NEW_SHAPE)
        if self._since_full[key] + 1 >= self.config.interval:
            return self._full(INTERVAL_DUE)
        self._since_full[key] += 1
        self.stats.reused_calls += 1
        return kept[1]

    def keep(self, key: Hashable, shapes: Any, features: torch.Tensor) -> None:
        self._kept[key] = (shapes, features)
        self._since_full[key] = 0
