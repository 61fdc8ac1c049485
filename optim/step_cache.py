"""Step caching: DeepCache for UNets and First Block Cache for diffusion transformers.

DeepCache: every ``interval`` model calls the whole UNet runs and the deep features entering its last
up-blocks are kept; the calls between run only the shallow branch (the first ``branch + 1``
down-blocks and the last ``branch + 1`` up-blocks) on those kept features.

The UNet is seen through ``UNetBlocks`` (its embedding, down, middle, up blocks and output head), so
the technique knows no host. ``full_forward`` and ``shallow_forward`` are pure functions of tensors,
so each can be compiled and captured in a CUDA graph of its own. ``CacheSchedule`` decides, per model
call, which one runs: it counts calls, not sampler steps, per key (input shapes and the batch's
cond/uncond layout), so second-order samplers and sequential CFG each keep their own features.

First Block Cache (``FirstBlockCache``): every call runs the transformer's first block; where the
change it made differs from the one the last full call's first block made by less than ``threshold``
(relative mean absolute difference), the later blocks are skipped and each group of blocks (Flux's
double and single blocks) adds the change it made on that full call. The transformer is seen as
named tensors passed block to block (``block``'s ``inputs``), so the technique knows no host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

import torch

from ..errors import Unavailable, UserError

DEEPCACHE, FIRST_BLOCK = "deepcache", "first_block"
MODES = (DEEPCACHE, FIRST_BLOCK)


@dataclass(frozen=True)
class StepCacheConfig:
    """``interval`` (deepcache): a full UNet every this many calls (1 caches nothing); ``branch``
    (deepcache): the skip level whose blocks still run on a cached call (0: only the outermost);
    ``threshold`` (first_block): the largest relative change of the first block's output change that
    still reuses the later blocks' (0 caches nothing); ``start``/``end``: the part of the schedule
    (fractions of the sampling steps) where calls may reuse features."""

    mode: str = DEEPCACHE
    # On ref-sd15 (the reference model trained here) interval 2 is the longest that draws the captions as
    # uncached does (within 3 points) and comes closer to the uncached image than as many calls of fewer
    # steps, on both evaluation sets; 3 tied with fewer steps, 4 and 5 lost to them (docs/benchmarks.md).
    interval: int = 2
    branch: int = 0
    start: float = 0.0
    end: float = 1.0
    # On ref-sd35 (32 pairs): the fastest threshold tried whose images drew the captions as uncached did and
    # came closer to the uncached image than fewer steps at the same model calls (12.5 calls of 20, 31.7
    # against 28.6 dB); 0.08 skipped 22% of calls. That model draws its captions poorly: on a real one,
    # compare with 0.08-0.12.
    threshold: float = 0.2

    def __post_init__(self):
        problem = None
        if self.mode not in MODES:
            problem = f"mode: {self.mode!r} is not one of {', '.join(MODES)}"
        elif self.interval < 1:
            problem = f"interval: {self.interval} must be at least 1 (1 runs the whole UNet on every call)"
        elif self.branch < 0:
            problem = f"branch: {self.branch} must be 0 or more"
        elif not 0.0 <= self.threshold <= 1.0:
            problem = f"threshold: {self.threshold} must be between 0 and 1 (a relative change; 0 caches nothing)"
        elif not 0.0 <= self.start < self.end <= 1.0:
            problem = f"start {self.start} and end {self.end}: need 0 <= start < end <= 1 (fractions of the schedule)"
        if problem:
            raise UserError(problem)

    @property
    def reuses_nothing(self) -> bool:
        """Whether these settings ask for no reuse at all (interval 1, threshold 0): every call runs whole,
        and the image is the uncached one."""
        return self.interval == 1 if self.mode == DEEPCACHE else self.threshold == 0.0

    @property
    def bounded(self) -> bool:
        """Whether the schedule's position matters (a start or end other than the whole run)."""
        return self.start > 0.0 or self.end < 1.0

    def settings(self) -> str:
        span = f", steps {self.start:.0%}–{self.end:.0%}" if self.bounded else ""
        if self.mode == FIRST_BLOCK:
            return f"{self.mode}: threshold {self.threshold:g}{span}"
        return f"{self.mode}: interval {self.interval}, branch {self.branch}{span}"

    def within(self, position: float | None) -> bool:
        """Whether a call at ``position`` (the fraction of the schedule done) may reuse features."""
        return not self.bounded or (position is not None and self.start <= position < self.end)


def unavailable(config: StepCacheConfig, device: torch.device | None, *, blocks: "UNetBlocks | None",
                block_groups: tuple[tuple[str, int], ...] = ()) -> Unavailable | None:
    """Why the cache cannot run on this model, with the fix, else None. Any device serves; what
    decides is the model's layout: ``blocks`` (None where it is not a UNet) for deepcache,
    ``block_groups`` (its transformer blocks, ``FirstBlockCache``'s groups) for first_block."""
    if config.mode == FIRST_BLOCK:
        if sum(count for _, count in block_groups) < 2:
            fix = "use mode deepcache" if blocks is not None else "leave sdopt Step Cache out for this model"
            return Unavailable("the model is not a diffusion transformer with a chain of blocks to skip (First Block Cache "
                               "skips the blocks after the first)", fix, "mode")
        return None
    if blocks is None:
        fix = "use mode first_block" if block_groups else "leave sdopt Step Cache out for this model"
        return Unavailable("the model is not a UNet with down, middle and up blocks (DeepCache needs its skip connections)",
                           fix, "mode")
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
    """One sampling run's calls; ``ran`` and ``reused`` say what a full and a cached call do."""

    full_calls: int = 0
    reused_calls: int = 0
    full_reasons: Counter = field(default_factory=Counter)
    ran: str = "ran the whole UNet"
    reused: str = "reused deep features"
    asked_to_reuse: bool = True  # False where the settings reuse nothing: no reuse is then no shortfall

    def summary(self) -> str:
        calls = self.full_calls + self.reused_calls
        if not calls:
            return "no model calls yet"
        return f"{self.full_calls} of {calls} calls {self.ran}, {self.reused_calls} {self.reused}"

    def shortfall(self) -> str:
        """What the cache did less than asked, or ''."""
        if self.asked_to_reuse and self.full_calls and not self.reused_calls:
            return "reused nothing: " + ", ".join(f"{reason} ({n}x)" for reason, n in self.full_reasons.items())
        return ""


FIRST_CALL, INTERVAL_DUE, OUTSIDE_SPAN, NEW_SHAPE, CHANGED, BYPASSED = (
    "first call of its shapes in this run", "interval due", "outside the cached part of the schedule", "new input shapes",
    "first block's change above the threshold", "run uncached")


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
        self.stats = StepCacheStats(asked_to_reuse=not config.reuses_nothing)
        self._kept: dict[Hashable, tuple[Any, torch.Tensor]] = {}
        self._since_full: dict[Hashable, int] = {}

    def reset(self) -> None:
        self.release()
        self.stats = StepCacheStats(asked_to_reuse=not self.config.reuses_nothing)

    def release(self) -> None:
        """Drop the kept features (the run's ``stats`` stay until the next ``reset``)."""
        self._kept.clear()
        self._since_full.clear()

    def _full(self, reason: str):
        self.stats.full_calls += 1
        self.stats.full_reasons[reason] += 1
        return None

    def decide(self, key: Hashable, shapes: Any, position: float | None = None) -> torch.Tensor | None:
        if not self.config.within(position):
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


def relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    """mean |new - old| / mean |old| (First Block Cache's measure), in fp32."""
    old = old.float()
    return float((new.float() - old).abs().mean() / old.abs().mean().clamp_min(1e-12))


Tensors = dict[str, "torch.Tensor | None"]


@dataclass
class _Kept:
    """What one key's last full call left: its shapes, its first block's change and, per group, the
    change that group's skippable blocks made (None for an output a block drops)."""

    shapes: Any
    first_change: torch.Tensor
    group_changes: dict[str, Tensors] = field(default_factory=dict)


class FirstBlockCache:
    """First Block Cache over a transformer whose blocks come in ``groups``, ``(name, count)`` in the
    order a forward runs them; ``compared`` names the tensor whose change the first block is judged by.

    Per model call: ``begin(key, shapes, position, bypass)`` (``bypass``: a reason to run this call
    uncached, or None), then ``block(group, index, inputs, run)`` for every block in order, where
    ``run()`` computes the block and returns its outputs by name, then ``finish()``. A skipped block returns its inputs
    (the outputs' names of the last full call) and the last block of a group adds what the group's
    skippable blocks changed on that full call. ``reset()`` starts a new sampling run.
    """

    def __init__(self, config: StepCacheConfig, groups: tuple[tuple[str, int], ...], compared: str):
        self.config = config
        self.groups = dict(groups)
        self.first_group = groups[0][0]
        self.skippable = tuple(name for name, count in groups if count > self._entry_index(name))
        self.compared = compared
        self.stats = self._new_stats()
        self._kept: dict[Hashable, _Kept] = {}
        self._call: tuple[Hashable, Any] | None = None
        self._position: float | None = None
        self._bypass: str | None = None
        self._skipping = False
        self._entries: dict[str, Tensors] = {}

    def _new_stats(self) -> StepCacheStats:
        return StepCacheStats(ran="ran every block", reused="skipped the blocks after the first",
                              asked_to_reuse=not self.config.reuses_nothing)

    def reset(self) -> None:
        self._kept.clear()
        self._call = None
        self.stats = self._new_stats()

    def begin(self, key: Hashable, shapes: Any, position: float | None = None, bypass: str | None = None) -> None:
        self._call, self._position, self._bypass = (key, shapes), position, bypass
        self._skipping = False
        self._entries = {}

    def release(self) -> None:
        """Drop the kept tensors (the run's ``stats`` stay until the next ``reset``)."""
        self._kept.clear()
        self.finish()

    def finish(self) -> None:
        """End the model call: blocks run plain until the next ``begin``."""
        self._call, self._entries, self._skipping = None, {}, False

    def _entry_index(self, group: str) -> int:
        """The first block of ``group`` a cached call skips."""
        return 1 if group == self.first_group else 0

    def block(self, group: str, index: int, inputs: Tensors, run) -> Tensors:
        if self._call is None:
            return run()
        if group == self.first_group and index == 0:
            return self._first(inputs, run())
        kept = self._kept.get(self._call[0])
        last = index == self.groups[group] - 1
        if self._skipping:
            changes = kept.group_changes[group]
            if index == self._entry_index(group):
                self._entries[group] = {name: inputs[name] for name in changes}
            if not last:
                return {name: inputs[name] for name in changes}
            entry = self._entries[group]
            return {name: None if change is None else entry[name] + change for name, change in changes.items()}
        if index == self._entry_index(group):
            self._entries[group] = dict(inputs)
        outputs = run()
        if last and kept is not None and self._bypass is None:
            entry = self._entries[group]
            kept.group_changes[group] = {name: None if value is None else value - entry[name] for name, value in outputs.items()}
        return outputs

    def _first(self, inputs: Tensors, outputs: Tensors) -> Tensors:
        # a new pass over the blocks: nothing of a pass before it in this call (a host that runs the
        # blocks twice per call) may decide this one
        self._skipping, self._entries = False, {}
        key, shapes = self._call
        change = outputs[self.compared] - inputs[self.compared]
        kept = self._kept.get(key)
        if self._bypass is not None:
            self._kept.pop(key, None)
            reason = BYPASSED + f" ({self._bypass})"
        elif not self.config.within(self._position):
            reason = OUTSIDE_SPAN
        elif kept is None:
            reason = FIRST_CALL
        elif kept.shapes != shapes:
            reason = NEW_SHAPE
        elif any(group not in kept.group_changes for group in self.skippable) or relative_change(change, kept.first_change) >= self.config.threshold:
            reason = CHANGED
        else:
            self._skipping = True
            self.stats.reused_calls += 1
            return outputs
        self.stats.full_calls += 1
        self.stats.full_reasons[reason] += 1
        if self._bypass is None:
            self._kept[key] = _Kept(shapes, change)
        return outputs
