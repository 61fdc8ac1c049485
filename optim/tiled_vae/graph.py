"""The step graph a VAE's decode or encode is rewritten into, and the regions its steps read.

Tileable steps (stride-1 "same" convolution, nearest 2x upsample, pad + stride-2 downsample,
GroupNorm + activation with given statistics, residual add, pointwise functions) know which
region of their input a region of their output needs; whole-tensor steps (the mid-block
attention at latent size) run on the whole value. ``Graph`` records the steps in execution order;
the adapters (``adapters.py``) build it from a VAE's modules.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import UnsupportedVAE

Region = tuple[int, int, int, int]  # y0, y1, x0, x1 in a value's own pixels, end exclusive


def clip(r: Region, size: tuple[int, int]) -> Region:
    return max(r[0], 0), min(r[1], size[0]), max(r[2], 0), min(r[3], size[1])


def grow(r: Region, by: int) -> Region:
    return r[0] - by, r[1] + by, r[2] - by, r[3] + by


def union(a: Region | None, b: Region) -> Region:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3]))


def area(r: Region) -> int:
    return (r[1] - r[0]) * (r[3] - r[2])


def crop(x: torch.Tensor, have: Region, want: Region) -> torch.Tensor:
    if have == want:
        return x
    return x[:, :, want[0] - have[0]:want[1] - have[0], want[2] - have[2]:want[3] - have[2]]


class Conv:
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
        return clip(grow(r, self.pad), size)

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        return crop(self.module(inputs[0]), have, r)


class Downsample:
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


class Upsample:
    """Nearest-neighbour 2x upsampling."""

    def __init__(self, channels: int):
        self.channels = channels

    def need(self, r: Region, size) -> Region:
        return r[0] // 2, -(-r[1] // 2), r[2] // 2, -(-r[3] // 2)

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        up = F.interpolate(inputs[0], scale_factor=2.0, mode="nearest")
        return crop(up, tuple(2 * v for v in have), r)


class Pointwise:
    def need(self, r: Region, size) -> Region:
        return r


class NormAct(Pointwise):
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


class Add(Pointwise):
    def __init__(self, channels: int, divide_by: float = 1.0):
        self.channels, self.divide_by = channels, divide_by

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        out = inputs[0] + inputs[1]
        return out / self.divide_by if self.divide_by != 1.0 else out


class Apply(Pointwise):
    """A pointwise function: tanh, the posterior's mode (the first half of the channels)."""

    def __init__(self, fn: Callable, channels: int):
        self.fn, self.channels = fn, channels

    def run(self, inputs, have: Region, r: Region) -> torch.Tensor:
        return self.fn(inputs[0])


class Whole:
    """A step run on the whole tensor (the mid-block attention at latent size)."""

    def __init__(self, module: nn.Module, channels: int):
        self.module, self.channels = module, channels


class Input:
    def __init__(self, channels: int):
        self.channels = channels


@dataclass(eq=False)
class Value:
    op: object
    inputs: tuple
    scale: int  # pixels of this value per latent pixel
    index: int
    keep: bool = False  # kept between passes: always for the residual stream
    intermediate: bool = False  # a residual block's inner activation: kept only when intermediates are

    @property
    def channels(self) -> int:
        return self.op.channels


class Graph:
    """The steps of one decode or encode, in execution order."""

    def __init__(self, in_channels: int, in_scale: int):
        self.values: list[Value] = []
        self.input = self._add(Input(in_channels), (), in_scale, keep=True)

    def _add(self, op, inputs, scale, keep=False, intermediate=False) -> Value:
        value = Value(op, tuple(inputs), scale, len(self.values), keep, intermediate)
        self.values.append(value)
        return value

    def conv(self, module, x: Value, intermediate=False) -> Value:
        return self._add(Conv(module), (x,), x.scale, intermediate=intermediate)

    def downsample(self, module, x: Value) -> Value:
        return self._add(Downsample(module), (x,), x.scale // 2)

    def upsample(self, x: Value) -> Value:
        return self._add(Upsample(x.channels), (x,), x.scale * 2)

    def norm_act(self, norm, activation, x: Value) -> Value:
        return self._add(NormAct(norm, activation, x.channels), (x,), x.scale)

    def add(self, a: Value, b: Value, divide_by=1.0) -> Value:
        return self._add(Add(b.channels, divide_by), (a, b), b.scale, keep=True)

    def apply(self, fn, x: Value, channels=None) -> Value:
        return self._add(Apply(fn, channels or x.channels), (x,), x.scale)

    def whole(self, module, x: Value) -> Value:
        x.keep = True
        return self._add(Whole(module, x.channels), (x,), x.scale, keep=True)

    def finish(self, output: Value) -> None:
        output.keep = True
        self.output = output

    def resnet(self, block, x: Value, activation, shortcut, divide_by=1.0) -> Value:
        h = self.norm_act(block.norm1, activation, x)
        h = self.conv(block.conv1, h, intermediate=True)
        h = self.norm_act(block.norm2, activation, h)
        h = self.conv(block.conv2, h)
        if shortcut is not None:
            x = self.conv(shortcut, x, intermediate=True)
        elif x.channels != h.channels:
            raise UnsupportedVAE("a residual block that changes channels without a shortcut convolution")
        return self.add(x, h, divide_by)

