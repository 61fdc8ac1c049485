"""Exact low-memory UNet execution: the same output with less working memory per op.

For resolutions where activations, not weights, break the memory budget. ``low_memory(config)``
is a context manager under which, without changing the model:

- ``F.group_norm`` computes its statistics over the whole tensor in row chunks (a numerically
  stable merge of per-chunk mean and variance), then normalizes chunk by chunk, so its float32
  working copy never exceeds the budget;
- ``F.conv2d`` runs over row slices of its output, each fed by the input rows it needs (the halo
  rows around it, zeros only at the tensor's own top and bottom), so the kernel's layout copies and
  workspace cover one slice;
- every module whose class name, or whose attribute name in its parent (Flux's generic ``img_mlp``),
  is in ``feedforward_modules`` (ComfyUI's and diffusers' ``FeedForward``, GEGLU included) runs over
  token slices, so its hidden activations (a GEGLU's projection is twice the inner width, then the
  GELU and the product) cover one slice.

An op runs chunked only when its estimated working memory exceeds ``budget_bytes``; each chunk is
sized to fit it. The output of every op is full size either way, so what this lowers is the
temporaries an op makes beyond its output. Two more pieces sit beside the context manager:
``sequential_batches`` splits a batched call (cond and uncond) along dim 0 and concatenates the
results, and ``run_low_memory`` runs one call (ComfyUI's ``apply_model``) in sequential batches under
the context manager. Attention in linear memory is the attention technique's ``low_memory`` backend
(PyTorch's fused kernels, else ``sub_quadratic`` within a budget), which the host sets through its
own per-model override.

What lowers the peak, measured on the mini SD1.5 UNet at 1024x1024, batch 2, 64 MiB budget
(CUDA fp16 and CPU fp32): sequential batches and feed-forward slicing, each by about a third;
chunked GroupNorm and sliced convs by a few tens of MiB on CPU and at most 5 MiB on CUDA, because
the native kernels make few temporaries beyond their output.

Chunk sizes come from shapes only (no data-dependent branching), so everything here also runs on
meta and fake tensors, which is how a memory planner predicts the peaks.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from ..errors import UserError
from .attention import HALF_DTYPES

# Chunked GroupNorm holds a chunk's float copy and one float temporary of the same size.
_GROUP_NORM_COPIES = 2
# A feed-forward's working set per token: its widest hidden layer plus one more of that width
# (GEGLU: the 2*inner projection, then GELU(gate) and the product, inner wide each).
_FEEDFORWARD_COPIES = 2


@dataclass(frozen=True)
class LowMemConfig:
    """What ``low_memory`` and ``run_low_memory`` do.

    ``budget_bytes``: the working memory (temporaries beyond the op's inputs and output) one op
    may use; ops estimated above it run in chunks sized to fit it. ``sequential_cfg``:
    ``run_low_memory`` runs the batch ``batch_chunk`` entries at a time (cond and uncond one after
    the other).
    ``feedforward_modules``: the token-wise modules that ``slice_feedforward`` runs over token
    slices (their input's second-to-last dim), by class name (``FeedForward``) or, for modules of a
    generic class, by their attribute name in their parent (Flux's ``img_mlp``, an ``nn.Sequential``).
    """

    budget_bytes: int
    sequential_cfg: bool = True
    chunk_groupnorm: bool = True
    slice_convs: bool = True
    slice_feedforward: bool = True
    batch_chunk: int = 1
    feedforward_modules: tuple[str, ...] = ("FeedForward",)

    def __post_init__(self):
        if self.budget_bytes <= 0:
            raise UserError(f"budget_bytes must be > 0 (got {self.budget_bytes}); give the working memory one op may use")
        if self.batch_chunk < 1:
            raise UserError(f"batch_chunk must be >= 1 (got {self.batch_chunk}); 1 runs cond and uncond one after the other")


# --- sequential batches ------------------------------------------------------------------------


PartLabel = Callable[[slice, int, tuple, dict], None]


def sequential_batches(fn: Callable[..., Any], x: torch.Tensor, *args: Any, batch_chunk: int = 1,
                       label_part: PartLabel | None = None, **kwargs: Any) -> Any:
    """``fn(x, *args, **kwargs)`` run ``batch_chunk`` batch entries at a time, results concatenated on dim 0.

    Every tensor whose dim 0 equals ``x``'s batch (in ``args``, ``kwargs`` and, recursively, in
    the dicts, lists and tuples they hold: conditioning, ControlNet residuals, per-sample sigmas)
    is sliced with ``x``; everything else is passed whole, in containers of the part's own.
    ``label_part(rows, batch, args, kwargs)`` may then change a part's containers in place (a
    host's per-row bookkeeping, which no tensor shape tells). The results (a tensor, or dicts,
    lists and tuples of them) are concatenated on dim 0.
    """
    batch = x.shape[0]
    if batch <= batch_chunk:
        return fn(x, *args, **kwargs)
    parts = []
    for start in range(0, batch, batch_chunk):
        rows = slice(start, min(start + batch_chunk, batch))
        part_args, part_kwargs = _batch_slice(args, rows, batch), _batch_slice(kwargs, rows, batch)
        if label_part is not None:
            label_part(rows, batch, part_args, part_kwargs)
        parts.append(fn(x[rows], *part_args, **part_kwargs))
    return _concat_batches(parts)


def _batch_slice(value: Any, rows: slice, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows] if value.ndim > 0 and value.shape[0] == batch else value
    if isinstance(value, Mapping):
        return {key: _batch_slice(item, rows, batch) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_batch_slice(item, rows, batch) for item in value)
    return value


def _concat_batches(parts: list) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {key: _concat_batches([part[key] for part in parts]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_concat_batches(list(items)) for items in zip(*parts))
    return first


# --- chunked ops -------------------------------------------------------------------------------


def group_norm_working_bytes(x: torch.Tensor) -> int:
    """The float32 working copy of ``x`` that an upcasting GroupNorm makes."""
    return x.numel() * _compute_dtype(x.dtype).itemsize


def chunked_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    budget_bytes: int,
) -> torch.Tensor:
    """``F.group_norm`` over ``x [N, C, D0, ...]`` in chunks of D0 rows whose float working set fits the budget.

    First pass: each chunk's per-(sample, channel) mean and variance, merged across chunks and
    then across each group's channels with Chan's parallel formula (stable, unlike a running sum
    of squares; per-channel reductions run over contiguous memory). Second pass:
    each chunk normalized in float32 (float64 for float64 input) and written into the output.
    """
    if x.ndim < 3:
        return F.group_norm(x, num_groups, weight, bias, eps)
    batch, channels, height = x.shape[:3]
    compute = _compute_dtype(x.dtype)
    row_bytes = _GROUP_NORM_COPIES * batch * channels * math.prod(x.shape[3:]) * compute.itemsize
    rows = _rows_within(budget_bytes, row_bytes, height)
    reduce = tuple(range(2, x.ndim))
    count, mean, m2 = 0, None, None  # per (sample, channel): values seen, their mean, sum of squared deviations
    for chunk in _row_chunks(x, rows):
        # Two passes over a chunk (mean, then squared deviations): exact, and several times faster
        # than torch.var_mean's Welford reduction on CPU.
        values = chunk.to(compute)
        chunk_mean = values.mean(dim=reduce, keepdim=True)
        chunk_m2 = (values - chunk_mean).square_().sum(dim=reduce)
        count, mean, m2 = _merge_moments(count, mean, m2, math.prod(chunk.shape[2:]), chunk_mean.flatten(1), chunk_m2)
    # The channels of a group hold equal counts: merge them the same way, all at once.
    channel_means = mean.reshape(batch, num_groups, -1)
    group_mean = channel_means.mean(dim=-1)
    group_m2 = m2.reshape(batch, num_groups, -1).sum(dim=-1) + count * (channel_means - group_mean[..., None]).square().sum(dim=-1)
    mean, m2, count = group_mean, group_m2, count * (channels // num_groups)
    # As ATen's kernels do: one per-(sample, channel) scale and shift, then one pass per chunk.
    per_channel = (batch, channels) + (1,) * (x.ndim - 2)

    def channelwise(per_group: torch.Tensor) -> torch.Tensor:
        return per_group.reshape(batch, num_groups, 1).expand(-1, -1, channels // num_groups).reshape(per_channel)

    scale = channelwise(torch.rsqrt(m2 / count + eps))
    if weight is not None:
        scale = scale * weight.to(compute).reshape(channels, *per_channel[2:])
    shift = -channelwise(mean) * scale
    if bias is not None:
        shift = shift + bias.to(compute).reshape(channels, *per_channel[2:])
    out = torch.empty_like(x)
    start = 0
    for chunk in _row_chunks(x, rows):
        out.narrow(2, start, chunk.shape[2]).copy_(torch.addcmul(shift, chunk, scale))
        start += chunk.shape[2]
    return out


def conv2d_working_bytes(x: torch.Tensor, weight: torch.Tensor, stride=1, padding=0, dilation=1) -> int:
    """What an unsliced ``F.conv2d`` may hold beyond its input and output: one layout copy of each.

    Measured on CPU, where oneDNN's reorders took about one input's worth; an upper bound for
    cuDNN, whose workspaces were a few MiB in the same UNet."""
    out_height, out_width = _conv_output_size(x, weight, _pair(stride), _pair(padding), _pair(dilation))
    return (x.numel() + x.shape[0] * weight.shape[0] * out_height * out_width) * x.element_size()


def sliced_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    *,
    budget_bytes: int,
) -> torch.Tensor:
    """``F.conv2d`` over ``x [N, C, H, W]`` in row slices of the output, each slice's working memory within the budget.

    Output rows ``[a, b)`` read input rows ``[a*s - p, (b-1)*s - p + d*(k-1) + 1)``; the rows of
    that range outside the input are the zero padding, added to the edge slices only, so every
    slice equals the same rows of the unsliced convolution.
    """
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    batch, _, height, width = x.shape
    out_channels, _, kernel_height, _ = weight.shape
    out_height, out_width = _conv_output_size(x, weight, stride, padding, dilation)
    reach = dilation[0] * (kernel_height - 1) + 1
    in_row_bytes = 2 * batch * x.shape[1] * width * x.element_size()
    out_row_bytes = 2 * batch * out_channels * out_width * x.element_size()
    halo_bytes = max(0, reach - stride[0]) * in_row_bytes
    rows = _rows_within(budget_bytes - halo_bytes, stride[0] * in_row_bytes + out_row_bytes, out_height)
    out = torch.empty(
        (batch, out_channels, out_height, out_width), dtype=x.dtype, device=x.device, memory_format=_memory_format(x)
    )
    for first in range(0, out_height, rows):
        last = min(first + rows, out_height)
        top = first * stride[0] - padding[0]
        bottom = (last - 1) * stride[0] - padding[0] + reach
        part = x[:, :, max(top, 0) : min(bottom, height)]
        if top < 0 or bottom > height:
            part = F.pad(part, (0, 0, max(0, -top), max(0, bottom - height)))
        sliced = F.conv2d(part, weight, bias, stride, (0, padding[1]), dilation, groups)
        out.narrow(2, first, last - first).copy_(sliced)
    return out


def feedforward_working_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """A token-wise module's hidden activations over all of ``x``'s tokens."""
    return _FEEDFORWARD_COPIES * _hidden_width(module, x) * (x.numel() // x.shape[-1]) * x.element_size()


def token_sliced(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens_per_slice: int) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn``, run over slices of ``x``'s second-to-last dim and written into one output."""
    dim = x.ndim - 2
    tokens = x.shape[dim]
    out = None
    for start in range(0, tokens, tokens_per_slice):
        length = min(tokens_per_slice, tokens - start)
        part = fn(x.narrow(dim, start, length))
        if out is None:
            out = part.new_empty(part.shape[:dim] + (tokens,) + part.shape[dim + 1 :])
        out.narrow(dim, start, length).copy_(part)
    return out


def feedforward_tokens_per_slice(module: nn.Module, x: torch.Tensor, budget_bytes: int) -> int:
    """Tokens per slice whose hidden activations fit the budget (at least one)."""
    dim = x.ndim - 2
    per_token = feedforward_working_bytes(module, x) // x.shape[dim]
    return _rows_within(budget_bytes, per_token, x.shape[dim])


# --- the context manager -----------------------------------------------------------------------


@contextlib.contextmanager
def low_memory(config: LowMemConfig, within: nn.Module | None = None) -> Iterator[None]:
    """Within the block, GroupNorm, conv2d and feed-forward modules whose working memory exceeds
    ``config.budget_bytes`` run chunked. Process-wide while active (a torch function mode and
    global module hooks); no module is changed. Feed-forwards named by attribute are looked up in
    ``within`` (the diffusion model)."""
    feedforward = _FeedForwardSlicer(config, within)
    with contextlib.ExitStack() as stack:
        if config.slice_feedforward:
            stack.callback(register_module_forward_pre_hook(feedforward.before).remove)
            stack.callback(register_module_forward_hook(feedforward.after, with_kwargs=True).remove)
        stack.enter_context(_LowMemoryMode(config))
        yield


def run_low_memory(
    config: LowMemConfig, fn: Callable[..., Any], x: torch.Tensor, *args: Any, within: nn.Module | None = None,
    label_part: PartLabel | None = None, **kwargs: Any
) -> Any:
    """``fn(x, *args, **kwargs)`` under ``low_memory(config, within)``, the batch split by ``sequential_batches``
    (each part labelled by ``label_part``) when ``config.sequential_cfg``: the whole technique around one UNet
    call (ComfyUI's ``apply_model``)."""
    with low_memory(config, within):
        if config.sequential_cfg:
            return sequential_batches(fn, x, *args, batch_chunk=config.batch_chunk, label_part=label_part, **kwargs)
        return fn(x, *args, **kwargs)


def chunkable(module: nn.Module, config: LowMemConfig) -> dict[str, int]:
    """How many of ``module``'s submodules ``low_memory(config, module)`` may run chunked, by kind:
    what a record says the technique can do on a model (a DiT has no GroupNorm, Flux's feed-forwards
    are found by attribute name)."""
    slicer = _FeedForwardSlicer(config, module)
    subs = list(module.modules())
    counts = {
        "feed-forwards": sum(type(m).__name__ in slicer.names or id(m) in slicer.named for m in subs) if config.slice_feedforward else 0,
        "GroupNorms": sum(isinstance(m, nn.GroupNorm) for m in subs) if config.chunk_groupnorm else 0,
        "convs": sum(isinstance(m, nn.Conv2d) for m in subs) if config.slice_convs else 0,
    }
    return counts


class _LowMemoryMode(TorchFunctionMode):
    def __init__(self, config: LowMemConfig):
        super().__init__()
        self.config = config

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        budget = self.config.budget_bytes
        if func is F.group_norm and self.config.chunk_groupnorm:
            x, num_groups, weight, bias, eps = _bind(args, kwargs, _GROUP_NORM_PARAMETERS)
            if x.ndim >= 3 and group_norm_working_bytes(x) > budget:
                return chunked_group_norm(x, num_groups, weight, bias, eps, budget_bytes=budget)
        elif func is F.conv2d and self.config.slice_convs:
            x, weight, bias, stride, padding, dilation, groups = _bind(args, kwargs, _CONV2D_PARAMETERS)
            if (
                x.ndim == 4
                and not isinstance(padding, str)
                and conv2d_working_bytes(x, weight, stride, padding, dilation) > budget
            ):
                return sliced_conv2d(x, weight, bias, stride, padding, dilation, groups, budget_bytes=budget)
        return func(*args, **kwargs)


# {model: {names: ids of its submodules with those attribute names}}: low_memory enters once per model
# call, and walking a UNet's thousands of modules on every step would cost milliseconds of a GPU step.
_NAMED_SUBMODULES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _named_submodules(module: nn.Module, names: frozenset[str]) -> frozenset[int]:
    """The ids of ``module``'s submodules whose attribute name in their parent is in ``names``,
    found once per module and set of names."""
    per_module = _NAMED_SUBMODULES.setdefault(module, {})
    if names not in per_module:
        per_module[names] = frozenset(id(sub) for name, sub in module.named_modules() if name.rpartition(".")[2] in names)
    return per_module[names]


class _FeedForwardSlicer:
    """Global forward hooks that run matching token-wise modules over token slices.

    A forward hook cannot skip the forward, so the pre-hook hands the real forward an empty
    (zero-token) view of an input that is over the budget, which costs nothing, and keeps the input;
    the forward hook, which sees the call's keyword arguments too, then returns the module run
    slice by slice on the kept input. The module is never touched.
    """

    def __init__(self, config: LowMemConfig, within: nn.Module | None = None):
        self.names = frozenset(config.feedforward_modules)
        # Modules of ``within`` matched by attribute name; class names match anywhere.
        self.named = _named_submodules(within, self.names) if within is not None else frozenset()
        self.budget = config.budget_bytes
        self.slicing: set[int] = set()
        self.pending: dict[int, torch.Tensor] = {}

    def before(self, module: nn.Module, args: tuple):
        if type(module).__name__ not in self.names and id(module) not in self.named:
            return None
        # A forward that raised leaves its input here; the module's next call must not see it.
        self.pending.pop(id(module), None)
        if id(module) in self.slicing or not args or not isinstance(args[0], torch.Tensor) or args[0].ndim < 2:
            return None
        x = args[0]
        if feedforward_working_bytes(module, x) <= self.budget:
            return None
        self.pending[id(module)] = x
        return (x.narrow(x.ndim - 2, 0, 0), *args[1:])

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        x = self.pending.pop(id(module), None)
        if x is None:
            return None
        self.slicing.add(id(module))
        try:
            return token_sliced(
                lambda part: module(part, *args[1:], **kwargs), x, feedforward_tokens_per_slice(module, x, self.budget)
            )
        finally:
            self.slicing.discard(id(module))


# --- helpers -----------------------------------------------------------------------------------

_GROUP_NORM_PARAMETERS = (("input", None), ("num_groups", None), ("weight", None), ("bias", None), ("eps", 1e-5))
_CONV2D_PARAMETERS = (
    ("input", None),
    ("weight", None),
    ("bias", None),
    ("stride", 1),
    ("padding", 0),
    ("dilation", 1),
    ("groups", 1),
)


def _bind(args: tuple, kwargs: dict, parameters: tuple[tuple[str, Any], ...]) -> list:
    """Positional and keyword arguments of a torch function as one list in signature order."""
    return [args[i] if i < len(args) else kwargs.get(name, default) for i, (name, default) in enumerate(parameters)]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF_DTYPES else dtype


def _merge_moments(count_a: int, mean_a, m2_a, count_b: int, mean_b, m2_b):
    """(count, mean, sum of squared deviations) of two sets of values together (Chan et al.)."""
    if mean_a is None:
        return count_b, mean_b, m2_b
    total = count_a + count_b
    delta = mean_b - mean_a
    return total, mean_a + delta * (count_b / total), m2_a + m2_b + delta.square() * (count_a * count_b / total)


def _rows_within(budget_bytes: int, row_bytes: int, total_rows: int) -> int:
    """Rows per chunk: as many as fit the budget, at least one, at most all."""
    return min(total_rows, max(1, budget_bytes // max(1, row_bytes)))


def _row_chunks(x: torch.Tensor, rows: int) -> Iterator[torch.Tensor]:
    for start in range(0, x.shape[2], rows):
        yield x.narrow(2, start, min(rows, x.shape[2] - start))


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _conv_output_size(x, weight, stride, padding, dilation) -> tuple[int, int]:
    return tuple(
        (size + 2 * pad - dil * (kernel - 1) - 1) // step + 1
        for size, kernel, step, pad, dil in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)
    )


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """channels_last when ``x`` is laid out that way (the unsliced conv's output would be too)."""
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _hidden_width(module: nn.Module, x: torch.Tensor) -> int:
    """The widest output among the module's matrices (its hidden width), or the input's width."""
    return max((p.shape[0] for p in module.parameters() if p.ndim == 2), default=x.shape[-1])
