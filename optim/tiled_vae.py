"""Tiled VAE decode and encode whose output matches the untiled one: GroupNorm over the whole image.

Host-independent: works on the autoencoder module it is given (ComfyUI's/LDM's ``AutoencoderKL``
or ``AutoencodingEngine``, or diffusers' ``AutoencoderKL``) by walking its known structure, never
changing it. ``tiled_decode``/``tiled_encode`` with a frozen ``TiledVAEConfig`` return the output
and ``TilingStats`` (tile used, tiles, passes, out-of-memory retries).

How: the network is rewritten as a small graph of tileable steps (convolution, nearest 2x
upsample, stride-2 downsample, GroupNorm+SiLU, residual add) plus whole-tensor steps (the
mid-block attention at latent size). Every GroupNorm is a synchronization point: the graph runs
layer-synchronously, one pass over all tiles per GroupNorm, and each pass accumulates the
per-group sums of its GroupNorm input over every tile's own (non-overlapping) core, so every
tile is normalized with the whole image's statistics. Within a pass a tile is computed on its
core plus the exact halo its convolutions need (a few pixels), so cores are exact and seams are
invisible; ``overlap`` additionally cross-fades the final tiles. Values that cross a pass are
kept per tile, cores only, in ``store_dtype`` (fp16 by default, exact fp32 where a tile would
overflow it); the residual stream is always kept, and the rest is kept or recomputed
(``keep_intermediates``) depending on what fits the budget.

Explicit walking of the known structure was chosen over torch.fx or a TorchFunctionMode: the
forward methods of these VAEs have data-dependent Python (dtype casts, optional blocks, batch
splitting) that tracing would bake in or trip on, and a step graph built from named submodules
says exactly which modules are supported; anything else raises ``UnsupportedVAE`` so a host can
run its own untiled path instead.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

DECODE = "decode"
ENCODE = "encode"
MIN_TILE = 64
TILE_STEP = 8
# Live-memory model: temporaries a step allocates beyond its output, in output sizes (a convolution's
# blocked-layout copies, the normalization before its activation, attention's q, k, v and scores),
# and the headroom for allocator slack.
_CONV_TEMPORARIES = 1.0
_NORM_TEMPORARIES = 1.0
_WHOLE_TEMPORARIES = 5.0
_HEADROOM = 1.3
# Above this mean²/variance, E[x²] - E[x]² in fp32 loses more than about 2e-5 of the variance (measured).
_CANCELLATION_RATIO = 4.0
_PROC_MEMINFO = Path("/proc/meminfo")

Region = tuple[int, int, int, int]  # y0, y1, x0, x1 in a value's own pixels, end exclusive


class UnsupportedVAE(ValueError):
    """The module is not a VAE this tiler knows; the message says what is missing."""


def check_tile_inputs(tile: int | None, overlap: int) -> str | None:
    """The one-line problem with these settings (naming the input), or None when they are valid.

    ``tile``: None or 0 is auto, else image pixels, a multiple of 8 and at least 64.
    ``overlap``: image pixels, a multiple of 8, smaller than ``tile``.
    """
    if tile:
        if tile < MIN_TILE:
            return f"tile: {tile} px is under the {MIN_TILE} px minimum; use {MIN_TILE} or more, or 0 for auto"
        if tile % TILE_STEP:
            lower, upper = tile // TILE_STEP * TILE_STEP, (tile // TILE_STEP + 1) * TILE_STEP
            return f"tile: {tile} px is not a multiple of 8; use {max(lower, MIN_TILE)} or {upper}, or 0 for auto"
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
    final tiles (cores are exact without it). ``budget_bytes``: None = the device's free memory.
    ``only_when_needed``: run the module untiled when its untiled peak is estimated to fit.
    ``store_dtype``: dtype of what is kept between passes when narrower than the compute dtype
    (None: the compute dtype). ``keep_intermediates``: also keep each residual block's inner
    activations instead of recomputing them (faster, more memory); None = when it fits the budget.
    ``min_tile``: the smallest tile that out-of-memory retries go down to.
    """

    tile: int | None = None
    overlap: int = 0
    budget_bytes: int | None = None
    only_when_needed: bool = False
    store_dtype: torch.dtype | None = torch.float16
    keep_intermediates: bool | None = None
    min_tile: int = MIN_TILE

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
    """What one tiled call did. Sizes are image pixels; bytes are the live-memory model's estimate."""

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
    reason: str = ""

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
        return f"{text}; {self.reason}" if self.reason else text


@dataclass(frozen=True)
class TiledResult:
    output: torch.Tensor
    stats: TilingStats


def free_memory(device: torch.device | str) -> int:
    """Bytes that ``device`` can still allocate: free VRAM plus PyTorch's unused cache on CUDA,
    MemAvailable (or psutil's available) for host memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if _PROC_MEMINFO.exists():
        for line in _PROC_MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        import psutil
    except ImportError:
        raise RuntimeError("cannot read the free host memory (no /proc/meminfo, no psutil): pass a budget") from None
    return psutil.virtual_memory().available


# --- regions ---------------------------------------------------------------------------------------


def _clip(r: Region, size: tuple[int, int]) -> Region:
    return max(r[0], 0), min(r[1], size[0]), max(r[2], 0), min(r[3], size[1])


def _grow(r: Region, by: int) -> Region:
    return r[0] - by, r[1] + by, r[2] - by, r[3] + by


def _union(a: Region | None, b: Region) -> Region:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3]))


def _area(r: Region) -> int:
    return (r[1] - r[0]) * (r[3] - r[2])


def _crop(x: torch.Tensor, have: Region, want: Region) -> torch.Tensor:
    if have == want:
        return x
    return x[:, :, want[0] - have[0]:want[1] - have[0], want[2] - have[2]:want[3] - have[2]]


# --- the step graph --------------------------------------------------------------------------------


class _Conv:
    """A stride-1 convolution with "same" zero padding: a region needs its input grown by the padding."""

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Conv2d):
            raise UnsupportedVAE(f"{type(module).__name__} is not a 2D convolution")
        k = module.kernel_size
        if module.stride != (1, 1) or module.dilation != (1, 1) or k[0] != k[1] or k[0] % 2 == 0 \
                or module.padding != (k[0] // 2, k[0] // 2) or module.padding_mode != "zeros":
            raise UnsupportedVAE(f"a convolution with kernel {k}, stride {module.stride}, padding {module.padding}")
        self.module, self.pad, self.channels = module, k[0] // 2, module.out_channels

    def need(self, r: Region, size) -> Region:
        return _clip(_grow(r, self.pad), size)

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        return _crop(self.module(inputs[0]), have, r)


class _Downsample:
    """Pad right and bottom by one, then a 3x3 convolution with stride 2 and no padding."""

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Conv2d) or module.kernel_size != (3, 3) or module.stride != (2, 2) \
                or module.padding != (0, 0) or module.dilation != (1, 1):
            raise UnsupportedVAE("a downsampling that is not pad(0, 1, 0, 1) + 3x3 convolution with stride 2")
        self.module, self.channels = module, module.out_channels

    def need(self, r: Region, size) -> Region:
        return 2 * r[0], min(2 * r[1] + 1, size[0]), 2 * r[2], min(2 * r[3] + 1, size[1])

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        x = inputs[0]
        bottom, right = 2 * r[1] + 1 - have[1], 2 * r[3] + 1 - have[3]
        if bottom or right:
            x = F.pad(x, (0, right, 0, bottom))
        return self.module(x)


class _Upsample:
    """Nearest-neighbour 2x upsampling."""

    def __init__(self, channels: int):
        self.channels = channels

    def need(self, r: Region, size) -> Region:
        return r[0] // 2, -(-r[1] // 2), r[2] // 2, -(-r[3] // 2)

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        up = F.interpolate(inputs[0], scale_factor=2.0, mode="nearest")
        return _crop(up, tuple(2 * v for v in have), r)


class _Pointwise:
    def need(self, r: Region, size) -> Region:
        return r


class _NormAct(_Pointwise):
    """GroupNorm with the whole image's statistics of its input, then the activation (if any)."""

    def __init__(self, norm: nn.Module, activation: Callable | None, channels: int):
        if not isinstance(norm, nn.GroupNorm):
            raise UnsupportedVAE(f"{type(norm).__name__} where a GroupNorm was expected")
        self.norm, self.activation, self.channels = norm, activation, channels
        self.groups = norm.num_groups
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None  # per-(sample, group) mean and variance

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        x = inputs[0]
        mean, var = (s.to(x.device, torch.float32) for s in self.stats)
        b, c = x.shape[:2]
        scale = torch.rsqrt(var + self.norm.eps).repeat_interleave(c // self.groups, dim=1)
        shift = -mean.repeat_interleave(c // self.groups, dim=1) * scale
        if self.norm.affine:
            weight = self.norm.weight.to(x.device, torch.float32)
            scale, shift = scale * weight, shift * weight + self.norm.bias.to(x.device, torch.float32)
        y = torch.addcmul(shift[:, :, None, None], x.float(), scale[:, :, None, None]).to(x.dtype)
        return self.activation(y) if self.activation is not None else y


class _Add(_Pointwise):
    def __init__(self, channels: int, divide_by: float = 1.0):
        self.channels, self.divide_by = channels, divide_by

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        out = inputs[0] + inputs[1]
        return out / self.divide_by if self.divide_by != 1.0 else out


class _Apply(_Pointwise):
    """A pointwise function: tanh, the posterior's mode (the first half of the channels)."""

    def __init__(self, fn: Callable, channels: int):
        self.fn, self.channels = fn, channels

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        return self.fn(inputs[0])


class _Whole:
    """A step run on the whole tensor (the mid-block attention at latent size)."""

    def __init__(self, module: nn.Module, channels: int):
        self.module, self.channels = module, channels


class _Input:
    def __init__(self, channels: int):
        self.channels = channels


@dataclass(eq=False)
class _Value:
    op: object
    inputs: tuple
    scale: int  # pixels of this value per latent pixel
    index: int
    keep: bool = False  # kept between passes: always for the residual stream
    intermediate: bool = False  # a residual block's inner activation: kept only when intermediates are

    @property
    def channels(self) -> int:
        return self.op.channels


class _Graph:
    """The steps of one decode or encode, in execution order."""

    def __init__(self, in_channels: int, in_scale: int):
        self.values: list[_Value] = []
        self.input = self._add(_Input(in_channels), (), in_scale, keep=True)

    def _add(self, op, inputs, scale, keep=False, intermediate=False) -> _Value:
        value = _Value(op, tuple(inputs), scale, len(self.values), keep, intermediate)
        self.values.append(value)
        return value

    def conv(self, module, x: _Value, intermediate=False) -> _Value:
        return self._add(_Conv(module), (x,), x.scale, intermediate=intermediate)

    def downsample(self, module, x: _Value) -> _Value:
        return self._add(_Downsample(module), (x,), x.scale // 2)

    def upsample(self, x: _Value) -> _Value:
        return self._add(_Upsample(x.channels), (x,), x.scale * 2)

    def norm_act(self, norm, activation, x: _Value) -> _Value:
        return self._add(_NormAct(norm, activation, x.channels), (x,), x.scale)

    def add(self, a: _Value, b: _Value, divide_by=1.0) -> _Value:
        return self._add(_Add(b.channels, divide_by), (a, b), b.scale, keep=True)

    def apply(self, fn, x: _Value, channels=None) -> _Value:
        return self._add(_Apply(fn, channels or x.channels), (x,), x.scale)

    def whole(self, module, x: _Value) -> _Value:
        x.keep = True
        return self._add(_Whole(module, x.channels), (x,), x.scale, keep=True)

    def finish(self, output: _Value) -> None:
        output.keep = True
        self.output = output

    def resnet(self, block, x: _Value, activation, shortcut, divide_by=1.0) -> _Value:
        h = self.norm_act(block.norm1, activation, x)
        h = self.conv(block.conv1, h, intermediate=True)
        h = self.norm_act(block.norm2, activation, h)
        h = self.conv(block.conv2, h)
        if shortcut is not None:
            x = self.conv(shortcut, x, intermediate=True)
        elif x.channels != h.channels:
            raise UnsupportedVAE("a residual block that changes channels without a shortcut convolution")
        return self.add(x, h, divide_by)


# --- the two module layouts ------------------------------------------------------------------------


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation module as a function; SiLU in place, on the normalization's fresh output."""
    return _silu if type(module) is nn.SiLU else module


def _mode(x: torch.Tensor) -> torch.Tensor:
    return x[:, : x.shape[1] // 2]


def _require(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise UnsupportedVAE(f"{type(obj).__name__} has no {', '.join(missing)}")


def _ldm_resnet(g: _Graph, block, x: _Value) -> _Value:
    _require(block, "norm1", "conv1", "norm2", "conv2")
    shortcut = getattr(block, "nin_shortcut", None)
    if shortcut is None:
        shortcut = getattr(block, "conv_shortcut", None)
    if getattr(block, "in_channels", x.channels) == getattr(block, "out_channels", x.channels):
        shortcut = None
    return g.resnet(block, x, _silu, shortcut)


def _diffusers_resnet(g: _Graph, block, x: _Value) -> _Value:
    _require(block, "norm1", "conv1", "norm2", "conv2", "nonlinearity")
    if getattr(block, "upsample", None) is not None or getattr(block, "downsample", None) is not None \
            or getattr(block, "time_emb_proj", None) is not None or getattr(block, "time_embedding_norm", "default") not in ("default", "group"):
        raise UnsupportedVAE("a residual block that resamples or takes a time embedding")
    return g.resnet(block, x, _activation(block.nonlinearity), getattr(block, "conv_shortcut", None), block.output_scale_factor)


def _ldm_upsample(g: _Graph, up, x: _Value) -> _Value:
    if getattr(up, "scale_factor", 2.0) not in (2.0, (2.0, 2.0)):
        raise UnsupportedVAE(f"an upsampling by {up.scale_factor}")
    x = g.upsample(x)
    return g.conv(up.conv, x) if up.with_conv else x


def _ldm_decoder(g: _Graph, dec, x: _Value) -> _Value:
    _require(dec, "conv_in", "mid", "up", "norm_out", "conv_out")
    x = g.conv(dec.conv_in, x)
    x = _ldm_resnet(g, dec.mid.block_1, x)
    x = g.whole(dec.mid.attn_1, x)
    x = _ldm_resnet(g, dec.mid.block_2, x)
    for level in reversed(range(len(dec.up))):
        stage = dec.up[level]
        for index, block in enumerate(stage.block):
            x = _ldm_resnet(g, block, x)
            if len(stage.attn) > 0:
                x = g.whole(stage.attn[index], x)
        if hasattr(stage, "upsample"):
            x = _ldm_upsample(g, stage.upsample, x)
    if getattr(dec, "give_pre_end", False):
        return x
    x = g.conv(dec.conv_out, g.norm_act(dec.norm_out, _silu, x))
    return g.apply(torch.tanh, x) if getattr(dec, "tanh_out", False) else x


def _ldm_encoder(g: _Graph, enc, x: _Value) -> _Value:
    _require(enc, "conv_in", "down", "mid", "norm_out", "conv_out")
    x = g.conv(enc.conv_in, x)
    for stage in enc.down:
        for index, block in enumerate(stage.block):
            x = _ldm_resnet(g, block, x)
            if len(stage.attn) > 0:
                x = g.whole(stage.attn[index], x)
        if hasattr(stage, "downsample"):
            if not stage.downsample.with_conv:
                raise UnsupportedVAE("a downsampling by average pooling")
            x = g.downsample(stage.downsample.conv, x)
    x = _ldm_resnet(g, enc.mid.block_1, x)
    x = g.whole(enc.mid.attn_1, x)
    x = _ldm_resnet(g, enc.mid.block_2, x)
    return g.conv(enc.conv_out, g.norm_act(enc.norm_out, _silu, x))


def _diffusers_mid(g: _Graph, mid, x: _Value) -> _Value:
    x = _diffusers_resnet(g, mid.resnets[0], x)
    for attention, block in zip(mid.attentions, mid.resnets[1:]):
        if attention is not None:
            x = g.whole(attention, x)
        x = _diffusers_resnet(g, block, x)
    return x


def _diffusers_decoder(g: _Graph, dec, x: _Value) -> _Value:
    _require(dec, "conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out")
    x = g.conv(dec.conv_in, x)
    x = _diffusers_mid(g, dec.mid_block, x)
    for stage in dec.up_blocks:
        if hasattr(stage, "attentions"):
            raise UnsupportedVAE(f"{type(stage).__name__} (attention in an up block)")
        for block in stage.resnets:
            x = _diffusers_resnet(g, block, x)
        for up in stage.upsamplers or ():
            if up.use_conv_transpose or not up.interpolate or getattr(up, "norm", None) is not None:
                raise UnsupportedVAE("an upsampling that is not nearest 2x + convolution")
            x = g.upsample(x)
            if up.use_conv:
                x = g.conv(up.conv if up.name == "conv" else up.Conv2d_0, x)
    return g.conv(dec.conv_out, g.norm_act(dec.conv_norm_out, _activation(dec.conv_act), x))


def _diffusers_encoder(g: _Graph, enc, x: _Value) -> _Value:
    _require(enc, "conv_in", "down_blocks", "mid_block", "conv_norm_out", "conv_act", "conv_out")
    x = g.conv(enc.conv_in, x)
    for stage in enc.down_blocks:
        if hasattr(stage, "attentions"):
            raise UnsupportedVAE(f"{type(stage).__name__} (attention in a down block)")
        for block in stage.resnets:
            x = _diffusers_resnet(g, block, x)
        for down in stage.downsamplers or ():
            if not down.use_conv or down.padding != 0 or getattr(down, "norm", None) is not None:
                raise UnsupportedVAE("a downsampling that is not pad(0, 1, 0, 1) + strided convolution")
            x = g.downsample(down.conv, x)
    x = _diffusers_mid(g, enc.mid_block, x)
    return g.conv(enc.conv_out, g.norm_act(enc.conv_norm_out, _activation(enc.conv_act), x))


@dataclass(frozen=True)
class _Layout:
    """One module layout: its graph and its own untiled call."""

    graph: _Graph
    untiled: Callable[[torch.Tensor], torch.Tensor]
    factor: int  # image pixels per latent pixel


def _layout(model: nn.Module, kind: str, channels: int) -> _Layout:
    if getattr(model, "bn", None) is not None:
        raise UnsupportedVAE("a VAE with a latent batch norm")
    coder = getattr(model, "decoder" if kind == DECODE else "encoder", None)
    if coder is None:
        raise UnsupportedVAE(f"{type(model).__name__} has no {'decoder' if kind == DECODE else 'encoder'}")
    diffusers = hasattr(coder, "mid_block")
    if diffusers:
        stages = coder.up_blocks if kind == DECODE else coder.down_blocks
        resamplings = sum(len(getattr(s, "upsamplers" if kind == DECODE else "downsamplers") or ()) for s in stages)
    else:
        stages = getattr(coder, "up" if kind == DECODE else "down", ())
        resamplings = sum(hasattr(s, "upsample" if kind == DECODE else "downsample") for s in stages)
    factor = 2**resamplings
    if kind == DECODE:
        g = _Graph(channels, 1)
        x = g.input
        if getattr(model, "post_quant_conv", None) is not None:
            x = g.conv(model.post_quant_conv, x)
        g.finish((_diffusers_decoder if diffusers else _ldm_decoder)(g, coder, x))
        untiled = (lambda z: model.decode(z).sample) if diffusers else model.decode
        return _Layout(g, untiled, factor)
    g = _Graph(channels, factor)
    x = (_diffusers_encoder if diffusers else _ldm_encoder)(g, coder, g.input)
    if getattr(model, "quant_conv", None) is not None:
        x = g.conv(model.quant_conv, x)
    if diffusers:
        g.finish(g.apply(_mode, x, x.channels // 2))
        return _Layout(g, lambda p: model.encode(p).latent_dist.mode(), factor)
    regularizer = getattr(model, "regularization", None)
    name = type(regularizer).__name__
    if "DiagonalGaussian" in name and not getattr(regularizer, "sample", False):
        x = g.apply(_mode, x, x.channels // 2)
    elif name != "EmptyRegularizer":
        raise UnsupportedVAE(f"a {name} latent regularizer")
    g.finish(x)
    return _Layout(g, model.encode, factor)


def unsupported_reason(model: nn.Module, kind: str = DECODE) -> str | None:
    """Why ``model``'s ``kind`` (decode or encode) cannot be tiled here, or None when it can."""
    try:
        _layout(model, kind, 1)
    except UnsupportedVAE as error:
        return str(error)
    return None


# --- passes ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Pass:
    """One sweep over every tile: computes ``keep`` values and the statistics of ``stats`` values."""

    keep: list[_Value]
    stats: list[_Value]
    order: list[_Value] = field(default_factory=list)  # computed values and read leaves, in graph order
    leaves: set = field(default_factory=set)


@dataclass(eq=False)
class _WholeStep:
    value: _Value


class _Grid:
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


def _schedule(graph: _Graph, keep_intermediates: bool) -> list:
    """Passes and whole-tensor steps in order: each GroupNorm input gets its statistics in the first
    pass that can compute it; kept values are computed as early as their GroupNorms allow."""
    kept = {v for v in graph.values if v.keep or (keep_intermediates and v.intermediate)}
    need_stats = {v.inputs[0] for v in graph.values if isinstance(v.op, _NormAct)}
    done, stats_known, steps = {graph.input}, set(), []
    if graph.input in need_stats:
        raise UnsupportedVAE("a GroupNorm directly on the input")

    def computable(v, memo):
        if v not in memo:
            if v in done:
                memo[v] = True
            elif isinstance(v.op, _Whole) or (isinstance(v.op, _NormAct) and v.inputs[0] not in stats_known):
                memo[v] = False
            else:
                memo[v] = all(computable(i, memo) for i in v.inputs)
        return memo[v]

    while graph.output not in done:
        whole = [v for v in graph.values if isinstance(v.op, _Whole) and v not in done and v.inputs[0] in done]
        if whole:
            steps.append(_WholeStep(whole[0]))
            done.add(whole[0])
            stats_known.add(whole[0])
            continue
        memo = {}
        keep = [v for v in graph.values if v in kept and v not in done and computable(v, memo)]
        stats = [v for v in graph.values if v in need_stats and v not in stats_known and computable(v, memo)]
        if not keep and not stats:
            raise UnsupportedVAE("a graph whose GroupNorms cannot be ordered")
        step = _Pass(keep, stats)
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


def _merge_stats(acc, count: int, mean: torch.Tensor, var: torch.Tensor):
    """Chan's parallel update of (count, mean, M2) per (sample, group), in float64 on the host."""
    mean, m2 = mean.double().cpu(), var.double().cpu() * count
    if acc is None:
        return count, mean, m2
    n, mean_a, m2_a = acc
    total = n + count
    delta = mean - mean_a
    return total, mean_a + delta * (count / total), m2_a + m2 + delta.square() * (n * count / total)


def _group_stats(x: torch.Tensor, groups: int):
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


class _Run:
    """One tiled execution of a graph on one input, at one tile size."""

    def __init__(self, graph: _Graph, steps: list, x_shape, tile_latent: int, overlap_out: int,
                 compute_dtype: torch.dtype, store_dtype: torch.dtype | None, device):
        self.graph, self.steps = graph, steps
        b, _, h, w = x_shape
        self.batch = b
        self.latent = (h // graph.input.scale, w // graph.input.scale)
        self.grid = _Grid(*self.latent, tile_latent)
        self.overlap = overlap_out
        self.passes = sum(isinstance(s, _Pass) for s in steps)
        self.compute_dtype, self.device = compute_dtype, device
        narrower = store_dtype is not None and torch.finfo(store_dtype).bits < torch.finfo(compute_dtype).bits
        self.store_dtype = store_dtype if narrower else compute_dtype
        self.norms = {}  # value -> the GroupNorm steps reading it
        for v in graph.values:
            if isinstance(v.op, _NormAct):
                self.norms.setdefault(v.inputs[0], []).append(v.op)
        self.last_step = {}  # kept value -> index of the last step that reads it
        for index, step in enumerate(steps):
            for v in (step.leaves if isinstance(step, _Pass) else (step.value.inputs[0],)):
                self.last_step[v] = index

    def size(self, v: _Value) -> tuple[int, int]:
        return self.latent[0] * v.scale, self.latent[1] * v.scale

    def _full(self, v: _Value) -> Region:
        return 0, self.size(v)[0], 0, self.size(v)[1]

    def _target(self, v: _Value, tile: int) -> Region:
        core = self.grid.core(tile, v.scale)
        if v is self.graph.output and self.overlap:
            return _clip(_grow(core, self.overlap // 2), self.size(v))
        return core

    def regions(self, step: _Pass, tile: int) -> dict:
        """The region of every value the tile computes or reads in ``step``."""
        need = {v: self._target(v, tile) for v in (*step.keep, *step.stats)}
        for v in reversed(step.order):
            if v in need and v not in step.leaves:
                for i in v.inputs:
                    need[i] = _union(need.get(i), v.op.need(need[v], self.size(i)))
        return need

    @staticmethod
    def _consumers(step: _Pass) -> dict:
        counts = {v: 0 for v in step.order}
        for v in step.order:
            if v not in step.leaves:
                for i in v.inputs:
                    counts[i] += 1
        return counts

    # --- the live-memory model ---

    def _bytes(self, v: _Value, r: Region, dtype: torch.dtype) -> int:
        return self.batch * v.channels * _area(r) * torch.empty((), dtype=dtype).element_size()

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
            if isinstance(step, _WholeStep):
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

    def _working(self, step: _Pass, need: dict) -> int:
        consumers = self._consumers(step)
        live = peak = 0
        for v in step.order:
            size = self._bytes(v, need[v], self.compute_dtype)
            peak = max(peak, live + size * (1 + _temporaries(v)))
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
            if isinstance(step, _WholeStep):
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

    def _release_schedule(self, step: _Pass, index: int, regions: list[dict]) -> dict[int, list]:
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

    def _split(self, x: torch.Tensor, v: _Value) -> dict[int, torch.Tensor]:
        whole = self._full(v)
        return {t: self._compact(_crop(x, whole, self.grid.core(t, v.scale))) for t in range(len(self.grid))}

    def _compact(self, x: torch.Tensor) -> torch.Tensor:
        if self.store_dtype == x.dtype:
            return x.clone()
        compact = x.to(self.store_dtype)
        low, high = torch.aminmax(compact)
        return compact if math.isfinite(low.item()) and math.isfinite(high.item()) else x.clone()

    def _gather(self, cores: dict[int, torch.Tensor] | torch.Tensor, v: _Value, r: Region) -> torch.Tensor:
        if isinstance(cores, torch.Tensor):
            return _crop(cores, self._full(v), r)
        tiles = self.grid.tiles_in(r, v.scale)
        if len(tiles) == 1:
            return _crop(cores[tiles[0]], self.grid.core(tiles[0], v.scale), r).to(self.compute_dtype)
        out = torch.empty(self.batch, v.channels, r[1] - r[0], r[3] - r[2], dtype=self.compute_dtype, device=self.device)
        for t in tiles:
            core = self.grid.core(t, v.scale)
            part = max(core[0], r[0]), min(core[1], r[1]), max(core[2], r[2]), min(core[3], r[3])
            _crop(out, r, part).copy_(_crop(cores[t], core, part))
        return out

    def _tile(self, step: _Pass, tile: int, need: dict, stores, accumulators) -> None:
        consumers = self._consumers(step)
        targets = {*step.keep, *step.stats}
        values = {}
        for v in step.order:
            r = need[v]
            if v in step.leaves:
                values[v] = self._gather(stores[v], v, r)
            else:
                regions = [v.op.need(r, self.size(i)) for i in v.inputs]
                values[v] = v.op.run([_crop(values[i], need[i], ri) for i, ri in zip(v.inputs, regions)], regions[0], r)
                for i in v.inputs:
                    consumers[i] -= 1
                    if consumers[i] == 0:
                        del values[i]
            if v in targets:
                self._finish(v, tile, values[v], r, stores, step, accumulators)
            if consumers[v] == 0:
                del values[v]

    def _finish(self, v: _Value, tile: int, x: torch.Tensor, r: Region, stores, step: _Pass, accumulators) -> None:
        core_region = self.grid.core(tile, v.scale)
        core = _crop(x, r, core_region)
        if v in step.stats:
            for norm in self.norms[v]:
                accumulators[norm] = _merge_stats(accumulators.get(norm), *_group_stats(core, norm.groups))
        if v is self.graph.output:
            self._write_output(x, r)
        elif v in step.keep:
            stores.setdefault(v, {})[tile] = self._compact(core)

    def _whole(self, v: _Value, stores) -> None:
        source = v.inputs[0]
        x = self._gather(stores[source], source, self._full(source))
        out = v.op.module(x)
        del x
        stores[v] = self._split(out, v)
        for norm in self.norms.get(v, ()):
            _, mean, var = _group_stats(out, norm.groups)
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
            _crop(self.output, whole, r).copy_(x)
            return
        weight = self._ramp(r, h, w, x.device)
        total, weights = self.output
        _crop(total, whole, r).addcmul_(x.float(), weight)
        _crop(weights, whole, r).add_(weight)

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


def _temporaries(v: _Value) -> float:
    if isinstance(v.op, (_Conv, _Downsample)):
        return _CONV_TEMPORARIES
    if isinstance(v.op, _NormAct):
        return _NORM_TEMPORARIES
    return _WHOLE_TEMPORARIES if isinstance(v.op, _Whole) else 0.0


def _untiled_estimate(graph: _Graph, x_shape, dtype: torch.dtype) -> int:
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
        peak = max(peak, live + size(v) * (1 + _temporaries(v)))
        live += size(v)
        for i in v.inputs:
            consumers[i] -= 1
            if consumers[i] == 0:
                live -= size(i)
    return int(peak * _HEADROOM)


# --- the verbs -------------------------------------------------------------------------------------


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
           progress: Callable[[int, int], None] | None) -> TiledResult:
    in_channels = x.shape[1]
    if x.ndim != 4:
        raise UnsupportedVAE(f"a {x.ndim - 2}D input (images only)")
    layout = _layout(model, kind, in_channels)
    graph, factor = layout.graph, layout.factor
    if kind == ENCODE and (x.shape[2] % factor or x.shape[3] % factor):
        raise UnsupportedVAE(f"an image whose sides {tuple(x.shape[2:])} are not multiples of {factor}")
    budget = config.budget_bytes if config.budget_bytes is not None else free_memory(x.device)
    untiled = _untiled_estimate(graph, x.shape, x.dtype)
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
    schedules = {keep: _schedule(graph, keep) for keep in (True, False)}

    def run_for(side: int, keep: bool) -> _Run:
        return _Run(graph, schedules[keep], x.shape, side, overlap, x.dtype, config.store_dtype, x.device)

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
        reason=reason)
    return TiledResult(out, stats)


def tiled_decode(model: nn.Module, latent: torch.Tensor, config: TiledVAEConfig = TiledVAEConfig(),
                 progress: Callable[[int, int], None] | None = None) -> TiledResult:
    """Decode ``latent`` (in the model's dtype and device) tile by tile with whole-image GroupNorm.

    ``model``: the autoencoder (``post_quant_conv`` and ``decoder``). ``progress(done, total)`` is
    called after every tile of every pass. Raises ``UnsupportedVAE`` for modules it does not know,
    and ``torch.OutOfMemoryError`` only when the smallest tile still does not fit.
    """
    return _tiled(model, latent, DECODE, config, progress)


def tiled_encode(model: nn.Module, pixels: torch.Tensor, config: TiledVAEConfig = TiledVAEConfig(),
                 progress: Callable[[int, int], None] | None = None) -> TiledResult:
    """Encode ``pixels`` (NCHW in [-1, 1], sides multiples of 8) tile by tile into the posterior's
    mode, as the untiled ``encode`` of ComfyUI's VAE returns it."""
    return _tiled(model, pixels, ENCODE, config, progress)
