"""Running a step graph tile by tile: the passes, the tile grid, whole-image GroupNorm statistics,
what is kept between passes, and the live-memory model that picks a tile.

Every GroupNorm is a synchronization point: the graph runs layer-synchronously, one pass over all
tiles per GroupNorm, and each pass accumulates the per-group sums of its GroupNorm input over
every tile's own (non-overlapping) core, so every tile is normalized with the whole image's
statistics. Within a pass a tile is computed on its core plus the exact halo its convolutions
need (a few pixels), so cores are exact and seams are invisible; ``overlap`` additionally
cross-fades the final tiles. Values that cross a pass are kept per tile, cores only, in the store
dtype (fp16 by default; a tile whose value passes its range is kept in the compute dtype, and
counted); the residual stream is always kept, and the rest is kept or recomputed
(``keep_intermediates``).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import UnsupportedVAE
from .graph import Conv, Downsample, Graph, NormAct, Region, Value, Whole, area, clip, crop, grow, union

# Live-memory model: temporaries a step allocates beyond its output, in output sizes (a convolution's
# blocked-layout copies, the normalization before its activation, attention's q, k, v and scores),
# and the headroom for allocator slack.
_CONV_TEMPORARIES = 1.0
_NORM_TEMPORARIES = 1.0
_WHOLE_TEMPORARIES = 5.0
_HEADROOM = 1.3
# Above this mean²/variance, E[x²] - E[x]² in fp32 loses more than about 2e-5 of the variance (measured).
_CANCELLATION_RATIO = 4.0


@dataclass(eq=False)
class Pass:
    """One sweep over every tile: computes ``keep`` values and the statistics of ``stats`` values."""

    keep: list[Value]
    stats: list[Value]
    order: list[Value] = field(default_factory=list)  # computed values and read leaves, in graph order
    leaves: set = field(default_factory=set)


@dataclass(eq=False)
class WholeStep:
    value: Value


class Grid:
    """Tiles over the latent grid, rows and columns split as evenly as the tile size allows."""

    def __init__(self, height: int, width: int, tile: int):
        self.rows = self._cuts(height, tile)
        self.cols = self._cuts(width, tile)

    @staticmethod
    def _cuts(length: int, tile: int) -> list[int]:
        n = max(1, -(-length // tile))
        return [round(i * length / n) for i in range(n + 1)]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows) - 1, len(self.cols) - 1

    def __len__(self) -> int:
        return self.shape[0] * self.shape[1]

    def core(self, tile: int, scale: int) -> Region:
        i, j = divmod(tile, self.shape[1])
        return self.rows[i] * scale, self.rows[i + 1] * scale, self.cols[j] * scale, self.cols[j + 1] * scale

    def tiles_in(self, r: Region, scale: int) -> list[int]:
        """The tiles whose core at ``scale`` intersects ``r``."""
        i0 = bisect.bisect_right(self.rows, r[0] / scale) - 1
        i1 = bisect.bisect_left(self.rows, r[1] / scale)
        j0 = bisect.bisect_right(self.cols, r[2] / scale) - 1
        j1 = bisect.bisect_left(self.cols, r[3] / scale)
        return [i * self.shape[1] + j for i in range(max(i0, 0), i1) for j in range(max(j0, 0), j1)]


def schedule(graph: Graph, keep_intermediates: bool) -> list:
    """Passes and whole-tensor steps in order: each GroupNorm input gets its statistics in the first
    pass that can compute it; kept values are computed as early as their GroupNorms allow."""
    kept = {v for v in graph.values if v.keep or (keep_intermediates and v.intermediate)}
    need_stats = {v.inputs[0] for v in graph.values if isinstance(v.op, NormAct)}
    done, stats_known, steps = {graph.input}, set(), []
    if graph.input in need_stats:
        raise UnsupportedVAE("a GroupNorm directly on the input")

    def computable(v, memo):
        if v not in memo:
            if v in done:
                memo[v] = True
            elif isinstance(v.op, Whole) or (isinstance(v.op, NormAct) and v.inputs[0] not in stats_known):
                memo[v] = False
            else:
                memo[v] = all(computable(i, memo) for i in v.inputs)
        return memo[v]

    while graph.output not in done:
        whole = [v for v in graph.values if isinstance(v.op, Whole) and v not in done and v.inputs[0] in done]
        if whole:
            steps.append(WholeStep(whole[0]))
            done.add(whole[0])
            stats_known.add(whole[0])
            continue
        memo = {}
        keep = [v for v in graph.values if v in kept and v not in done and computable(v, memo)]
        stats = [v for v in graph.values if v in need_stats and v not in stats_known and computable(v, memo)]
        if not keep and not stats:
            raise UnsupportedVAE("a graph whose GroupNorms cannot be ordered")
        step = Pass(keep, stats)
        needed = set()
        for v in reversed(graph.values):
            if v in keep or v in stats or v in needed:
                if v in done:
                    step.leaves.add(v)
                else:
                    needed.update(v.inputs)
                step.order.append(v)
        step.order.reverse()
        steps.append(step)
        done.update(keep)
        stats_known.update(stats)
    return steps


def merge_stats(acc, count: int, mean: torch.Tensor, var: torch.Tensor):
    """Chan's parallel update of (count, mean, M2) per (sample, group), in float64 on the host."""
    mean, m2 = mean.double().cpu(), var.double().cpu() * count
    if acc is None:
        return count, mean, m2
    n, mean_a, m2_a = acc
    total = n + count
    delta = mean - mean_a
    return total, mean_a + delta * (count / total), m2_a + m2 + delta.square() * (n * count / total)


def group_stats(x: torch.Tensor, groups: int):
    """(count per group, mean, biased variance) of ``x`` per (sample, group), computed in fp32.

    Sum and sum of squares are one fast pass; where the mean dominates the spread, their difference
    loses digits, and those tiles are redone with Welford's ``var_mean``.
    """
    grouped = x.float().unflatten(1, (groups, -1))
    count = grouped[0, 0].numel()
    mean = grouped.sum(dim=(2, 3, 4)) / count
    var = torch.linalg.vector_norm(grouped, dim=(2, 3, 4)).square() / count - mean.square()
    if (mean.square() > _CANCELLATION_RATIO * var).any():
        var, mean = torch.var_mean(grouped, dim=(2, 3, 4), correction=0)
    return count, mean, var.clamp_min(0)


class Run:
    """One tiled execution of a graph on one input, at one tile size."""

    def __init__(self, graph: Graph, steps: list, x_shape, tile_latent: int, overlap_out: int,
                 compute_dtype: torch.dtype, store_dtype: torch.dtype | None, device):
        self.graph, self.steps = graph, steps
        b, _, h, w = x_shape
        self.batch = b
        self.latent = (h // graph.input.scale, w // graph.input.scale)
        self.grid = Grid(*self.latent, tile_latent)
        self.overlap = overlap_out
        self.passes = sum(isinstance(s, Pass) for s in steps)
        self.compute_dtype, self.device = compute_dtype, device
        narrower = store_dtype is not None and torch.finfo(store_dtype).bits < torch.finfo(compute_dtype).bits
        self.store_dtype = store_dtype if narrower else compute_dtype
        self.stored = self.stored_wide = 0  # tile values kept in the store dtype or, past its range, wide
        self.norms = {}  # value -> the GroupNorm steps reading it
        for v in graph.values:
            if isinstance(v.op, NormAct):
                self.norms.setdefault(v.inputs[0], []).append(v.op)
        self.last_step = {}  # kept value -> index of the last step that reads it
        for index, step in enumerate(steps):
            for v in (step.leaves if isinstance(step, Pass) else (step.value.inputs[0],)):
                self.last_step[v] = index

    def size(self, v: Value) -> tuple[int, int]:
        return self.latent[0] * v.scale, self.latent[1] * v.scale

    def _full(self, v: Value) -> Region:
        return 0, self.size(v)[0], 0, self.size(v)[1]

    def _target(self, v: Value, tile: int) -> Region:
        core = self.grid.core(tile, v.scale)
        if v is self.graph.output and self.overlap:
            return clip(grow(core, self.overlap // 2), self.size(v))
        return core

    def regions(self, step: Pass, tile: int) -> dict:
        """The region of every value the tile computes or reads in ``step``."""
        need = {v: self._target(v, tile) for v in (*step.keep, *step.stats)}
        for v in reversed(step.order):
            if v in need and v not in step.leaves:
                for i in v.inputs:
                    need[i] = union(need.get(i), v.op.need(need[v], self.size(i)))
        return need

    @staticmethod
    def _consumers(step: Pass) -> dict:
        counts = {v: 0 for v in step.order}
        for v in step.order:
            if v not in step.leaves:
                for i in v.inputs:
                    counts[i] += 1
        return counts

    # --- the live-memory model ---

    def _bytes(self, v: Value, r: Region, dtype: torch.dtype) -> int:
        return self.batch * v.channels * area(r) * torch.empty((), dtype=dtype).element_size()

    def estimate(self) -> int:
        """Peak bytes of this run: the kept values alive at each step plus one tile's working set
        (the first tile and a middle one, which has halos on every side), plus the output.

        Within a pass, values read for the last time are freed tile by tile while the pass's own
        kept values grow tile by tile; the freeing lags by about one row of tiles (the halos)."""
        output = self._bytes(self.graph.output, self._full(self.graph.output), self.compute_dtype)
        output = output * 2 if self.overlap else output
        rows, cols = self.grid.shape
        lag = min(1.0, (cols + 1) / (rows * cols))
        probes = {0, (rows // 2) * cols + cols // 2}
        full = lambda v: self._bytes(v, self._full(v), self.store_dtype)
        alive, peak = set(), 0  # the input is the caller's, resident already
        for index, step in enumerate(self.steps):
            leaving = {v for v in alive if self.last_step.get(v, -1) <= index}
            staying = sum(full(v) for v in alive - leaving)
            if isinstance(step, WholeStep):
                working = self._bytes(step.value, self._full(step.value), self.compute_dtype) * (2 + _WHOLE_TEMPORARIES)
                stored = staying + sum(full(v) for v in leaving) + full(step.value)
                alive.add(step.value)
            else:
                written = sum(full(v) for v in step.keep if v is not self.graph.output)
                freed = sum(full(v) for v in leaving)
                stored = staying + max(freed, written) + freed * lag
                working = max(self._working(step, self.regions(step, t)) for t in probes)
                alive.update(v for v in step.keep if v is not self.graph.output)
            peak = max(peak, stored + working)
            alive -= leaving
        return int((peak + output) * _HEADROOM)

    def _working(self, step: Pass, need: dict) -> int:
        consumers = self._consumers(step)
        live = peak = 0
        for v in step.order:
            size = self._bytes(v, need[v], self.compute_dtype)
            peak = max(peak, live + size * (1 + temporaries(v)))
            live += size
            if v not in step.leaves:
                for i in v.inputs:
                    consumers[i] -= 1
                    if consumers[i] == 0:
                        live -= self._bytes(i, need[i], self.compute_dtype)
        return peak

    # --- execution ---

    def execute(self, x: torch.Tensor, progress: Callable[[int, int], None] | None) -> torch.Tensor:
        stores = {self.graph.input: x}  # the caller's input is read in place, never copied
        self.output = None
        total, done = self.passes * len(self.grid), 0
        for index, step in enumerate(self.steps):
            if isinstance(step, WholeStep):
                self._whole(step.value, stores)
            else:
                accumulators = {}
                regions = [self.regions(step, t) for t in range(len(self.grid))]
                release = self._release_schedule(step, index, regions)
                for tile, need in enumerate(regions):
                    self._tile(step, tile, need, stores, accumulators)
                    for v, core in release.get(tile, ()):
                        if isinstance(stores[v], dict):
                            stores[v].pop(core, None)
                    done += 1
                    if progress is not None:
                        progress(done, total)
                for norm, (n, mean, m2) in accumulators.items():
                    norm.stats = (mean.float(), (m2 / n).float())
            for v in [v for v in stores if self.last_step.get(v, -1) <= index]:
                del stores[v]
        output, self.output = self.output, None
        return output if not self.overlap else (output[0] / output[1]).to(self.compute_dtype)

    def _release_schedule(self, step: Pass, index: int, regions: list[dict]) -> dict[int, list]:
        """For kept values read here for the last time: after which tile each core can be freed."""
        last_reader = {}
        for v in step.leaves:
            if self.last_step.get(v) == index:
                for t, need in enumerate(regions):
                    for core in self.grid.tiles_in(need[v], v.scale):
                        last_reader[(v, core)] = t
        release: dict[int, list] = {}
        for key, t in last_reader.items():
            release.setdefault(t, []).append(key)
        return release

    def _split(self, x: torch.Tensor, v: Value) -> dict[int, torch.Tensor]:
        whole = self._full(v)
        return {t: self._compact(crop(x, whole, self.grid.core(t, v.scale))) for t in range(len(self.grid))}

    def _compact(self, x: torch.Tensor) -> torch.Tensor:
        """A tile's value to keep: in the store dtype, or, where it passes that dtype's range (the
        SDXL VAE's activations pass fp16's), in the compute dtype, counted in ``stored_wide``."""
        if self.store_dtype == x.dtype:
            return x.clone()
        self.stored += 1
        compact = x.to(self.store_dtype)
        low, high = torch.aminmax(compact)
        if math.isfinite(low.item()) and math.isfinite(high.item()):
            return compact
        self.stored_wide += 1
        return x.clone()

    def _gather(self, cores: dict[int, torch.Tensor] | torch.Tensor, v: Value, r: Region) -> torch.Tensor:
        if isinstance(cores, torch.Tensor):
            return crop(cores, self._full(v), r)
        tiles = self.grid.tiles_in(r, v.scale)
        if len(tiles) == 1:
            return crop(cores[tiles[0]], self.grid.core(tiles[0], v.scale), r).to(self.compute_dtype)
        out = torch.empty(self.batch, v.channels, r[1] - r[0], r[3] - r[2], dtype=self.compute_dtype, device=self.device)
        for t in tiles:
            core = self.grid.core(t, v.scale)
            part = max(core[0], r[0]), min(core[1], r[1]), max(core[2], r[2]), min(core[3], r[3])
            crop(out, r, part).copy_(crop(cores[t], core, part))
        return out

    def _tile(self, step: Pass, tile: int, need: dict, stores, accumulators) -> None:
        consumers = self._consumers(step)
        targets = {*step.keep, *step.stats}
        values = {}
        for v in step.order:
            r = need[v]
            if v in step.leaves:
                values[v] = self._gather(stores[v], v, r)
            else:
                regions = [v.op.need(r, self.size(i)) for i in v.inputs]
                values[v] = v.op.run([crop(values[i], need[i], ri) for i, ri in zip(v.inputs, regions)], regions[0], r)
                for i in v.inputs:
                    consumers[i] -= 1
                    if consumers[i] == 0:
                        del values[i]
            if v in targets:
                self._finish(v, tile, values[v], r, stores, step, accumulators)
            if consumers[v] == 0:
                del values[v]

    def _finish(self, v: Value, tile: int, x: torch.Tensor, r: Region, stores, step: Pass, accumulators) -> None:
        core_region = self.grid.core(tile, v.scale)
        core = crop(x, r, core_region)
        if v in step.stats:
            for norm in self.norms[v]:
                accumulators[norm] = merge_stats(accumulators.get(norm), *group_stats(core, norm.groups))
        if v is self.graph.output:
            self._write_output(x, r)
        elif v in step.keep:
            stores.setdefault(v, {})[tile] = self._compact(core)

    def _whole(self, v: Value, stores) -> None:
        source = v.inputs[0]
        x = self._gather(stores[source], source, self._full(source))
        out = v.op.module(x)
        del x
        stores[v] = self._split(out, v)
        for norm in self.norms.get(v, ()):
            _, mean, var = group_stats(out, norm.groups)
            norm.stats = (mean, var)

    def _write_output(self, x: torch.Tensor, r: Region) -> None:
        v = self.graph.output
        h, w = self.size(v)
        whole = (0, h, 0, w)
        if self.output is None:
            shape = (self.batch, v.channels, h, w)
            self.output = torch.empty(shape, dtype=x.dtype, device=x.device) if not self.overlap else \
                (torch.zeros(shape, dtype=torch.float32, device=x.device), torch.zeros(1, 1, h, w, device=x.device))
        if not self.overlap:
            crop(self.output, whole, r).copy_(x)
            return
        weight = self._ramp(r, h, w, x.device)
        total, weights = self.output
        crop(total, whole, r).addcmul_(x.float(), weight)
        crop(weights, whole, r).add_(weight)

    def _ramp(self, r: Region, h: int, w: int, device) -> torch.Tensor:
        """Linear cross-fade weights across the overlap band on each side that has a neighbour; the
        two tiles' weights sum to one there."""
        band = 2 * (self.overlap // 2)

        def axis(start, end, length):
            pos = torch.arange(start, end, device=device, dtype=torch.float32) + 0.5
            ramp = torch.ones_like(pos)
            if start > 0:
                ramp = torch.minimum(ramp, (pos - start) / band)
            if end < length:
                ramp = torch.minimum(ramp, (end - pos) / band)
            return ramp

        return axis(r[0], r[1], h)[:, None] * axis(r[2], r[3], w)[None, :]


def temporaries(v: Value) -> float:
    if isinstance(v.op, (Conv, Downsample)):
        return _CONV_TEMPORARIES
    if isinstance(v.op, NormAct):
        return _NORM_TEMPORARIES
    return _WHOLE_TEMPORARIES if isinstance(v.op, Whole) else 0.0


def untiled_estimate(graph: Graph, x_shape, dtype: torch.dtype) -> int:
    """Peak bytes of the module's own forward on the whole input: every activation at full size,
    each freed after its last use, attention temporaries included."""
    b, _, h, w = x_shape
    item = torch.empty((), dtype=dtype).element_size()
    size = lambda v: b * v.channels * (h // graph.input.scale * v.scale) * (w // graph.input.scale * v.scale) * item
    consumers = {v: 0 for v in graph.values}
    for v in graph.values:
        for i in v.inputs:
            consumers[i] += 1
    live, peak = size(graph.input), 0
    for v in graph.values[1:]:
        peak = max(peak, live + size(v) * (1 + temporaries(v)))
        live += size(v)
        for i in v.inputs:
            consumers[i] -= 1
            if consumers[i] == 0:
                live -= size(i)
    return int(peak * _HEADROOM)

