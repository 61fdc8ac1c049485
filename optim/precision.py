"""Precision: weight storage dtype, compute dtype, TF32, channels-last, and a NaN guard.

Host-independent. ``apply_precision_(module, PrecisionConfig(...))`` changes a module in
place, like torchao's ``quantize_``: weights of Linear/Conv/Embedding layers are stored
in ``weight_dtype`` and, when that differs from ``compute_dtype``, upcast on the fly by
a parametrization (so fp8 storage computes in fp16, bf16 or fp32); everything else
(norms, biases, buffers) is kept in the compute dtype. Apply it to a copy
(``converted_copy`` or ``copy.deepcopy``) when the original must stay as it is.

TF32 is process-global, so it is a scope (``tf32_scope``) around the calls that should
use it, never a property of a module. ``run_with_nan_guard`` redoes a decode/encode
whose output has NaN/Inf in a safer dtype: the fp16 VAE black-image problem.

Problems with the requested dtypes are ``UserError``s whose message starts with the
name of the input (``weight_dtype``, ``compute_dtype``, ...).
"""
from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
WEIGHT_DTYPES = tuple(DTYPES)
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# torch >= 2.9 also keeps TF32 settings per backend ("fp32_precision"), next to the legacy
# allow_tf32 flags and float32 matmul precision; tf32_scope restores both layers.
_FP32_PRECISION_KNOBS = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (``fp16``, ``fp8_e4m3fn``, ...) of a dtype, or torch's name for others."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype(name: str, input_name: str, offered: tuple[str, ...] = WEIGHT_DTYPES) -> torch.dtype:
    """The dtype called ``name``; a ``UserError`` naming ``input_name`` when it is not offered there."""
    if name in offered:
        return DTYPES[name]
    if name in DTYPES and DTYPES[name].itemsize == 1:
        raise UserError(
            f"{input_name}: {name} is a storage format and cannot be a compute dtype; "
            f"choose one of {', '.join(offered)} (fp8 belongs in weight_dtype)"
        )
    raise UserError(f"{input_name}: {name!r} is not offered; choose one of {', '.join(offered)}")


@functools.lru_cache(maxsize=None)
def _computes(device: str, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(1, 2, 4, 4, device=device, dtype=dtype)
        y = F.conv2d(x, torch.ones(2, 2, 3, 3, device=device, dtype=dtype), padding=1).flatten(1)
        return bool(torch.isfinite(y @ y.T).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def compute_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``device`` runs a conv and a matmul in ``dtype`` (probed once, then cached)."""
    if dtype == torch.float32:
        return True
    if dtype.itemsize == 1 or not dtype.is_floating_point:
        return False
    return _computes(str(torch.device(device)), dtype)


def check_compute_dtype(dtype: torch.dtype, device: torch.device | str, input_name: str = "compute_dtype") -> None:
    """A ``UserError`` naming ``input_name`` unless ``device`` can compute in ``dtype``."""
    if dtype.itemsize == 1:
        parse_dtype(dtype_name(dtype), input_name, COMPUTE_DTYPES)
    if not compute_supported(dtype, device):
        raise UserError(
            f"{input_name}: {dtype_name(dtype)} does not run on {torch.device(device)} "
            "(a test conv/matmul failed there); choose fp32 or another dtype"
        )


def safe_dtype(current: torch.dtype, device: torch.device | str) -> torch.dtype | None:
    """The dtype to redo a non-finite computation in: bf16 (fp32's range) where ``device``
    computes it and ``current`` is narrower, else fp32; None when ``current`` is already fp32."""
    if current == torch.float32:
        return None
    if current != torch.bfloat16 and compute_supported(torch.bfloat16, device):
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class PrecisionConfig:
    """What to change; None keeps what the module has (see ``plan_precision``)."""

    weight_dtype: str | None = None
    compute_dtype: str | None = None
    tf32: bool = False
    channels_last: bool = False

    def __post_init__(self):
        if self.weight_dtype is not None:
            parse_dtype(self.weight_dtype, "weight_dtype", WEIGHT_DTYPES)
        if self.compute_dtype is not None:
            parse_dtype(self.compute_dtype, "compute_dtype", COMPUTE_DTYPES)


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes that will actually be used, resolved for one module on one device."""

    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    tf32: bool
    channels_last: bool

    @property
    def upcasts(self) -> bool:
        """Weights are stored in another dtype than they are computed in."""
        return self.weight_dtype != self.compute_dtype


def plan_precision(
    config: PrecisionConfig, stored: torch.dtype, computing: torch.dtype, device: torch.device | str
) -> PrecisionPlan:
    """Resolve ``config`` for a model whose weights are ``stored`` in one dtype and computed in ``computing``.

    The compute dtype is the requested one (checked on ``device``); without one, a new
    weight dtype that ``device`` computes in is also the compute dtype (like
    ``module.half()``), and otherwise (fp8, or a dtype the device does not run) the
    model keeps computing as it does now.
    """
    weight = DTYPES[config.weight_dtype] if config.weight_dtype else stored
    if config.compute_dtype:
        compute = DTYPES[config.compute_dtype]
        check_compute_dtype(compute, device, "compute_dtype")
    elif config.weight_dtype and compute_supported(weight, device):
        compute = weight
    else:
        compute = computing if compute_supported(computing, device) else torch.float32
    return PrecisionPlan(weight, compute, config.tf32, config.channels_last)


@dataclass(frozen=True)
class PrecisionResult:
    plan: PrecisionPlan
    weight_bytes_before: int
    weight_bytes_after: int

    @property
    def saved_bytes(self) -> int:
        return self.weight_bytes_before - self.weight_bytes_after

    def scope(self) -> contextlib.AbstractContextManager:
        """The process-wide settings the plan needs (TF32), for ``with`` around the module's calls."""
        return tf32_scope() if self.plan.tf32 else contextlib.nullcontext()


def weight_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``module``'s parameters as stored, or with every floating-point one stored in ``dtype``."""
    return sum(
        p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
        for p in module.parameters()
    )


def _dominant_dtype(module: nn.Module) -> torch.dtype:
    counts = Counter()
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


def _module_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


class _ReadAs(nn.Module):
    """Parametrization: the stored weight is read in ``compute``."""

    def __init__(self, compute: torch.dtype):
        super().__init__()
        self.compute = compute

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(self.compute)


def _memory_format(t: torch.Tensor, channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last and t.ndim == 4 else torch.preserve_format


def _is_matrix_weight(name: str, p: torch.Tensor) -> bool:
    return name == "weight" and p.ndim >= 2


@torch.no_grad()
def apply_precision_(
    module: nn.Module, config: PrecisionConfig, device: torch.device | str | None = None
) -> PrecisionResult:
    """Change ``module`` in place to ``config`` and say what was done.

    ``device`` (default: where the module's parameters are) is where the compute dtype
    is checked. Apply once per module: a module that already has this parametrization
    is refused.
    """
    if any(parametrize.is_parametrized(sub) for sub in module.modules()):
        raise UserError("module: it already has parametrized weights; apply precision to a fresh copy")
    device = torch.device(device) if device is not None else _module_device(module)
    current = _dominant_dtype(module)
    plan = plan_precision(config, stored=current, computing=current, device=device)
    before = weight_bytes(module)
    for sub in list(module.modules()):
        for name, p in list(sub.named_parameters(recurse=False)):
            if not p.is_floating_point():
                continue
            fmt = _memory_format(p, plan.channels_last)
            if plan.upcasts and _is_matrix_weight(name, p):
                p.data = p.data.to(dtype=plan.weight_dtype, memory_format=fmt)
                parametrize.register_parametrization(sub, name, _ReadAs(plan.compute_dtype), unsafe=True)
            else:
                p.data = p.data.to(dtype=plan.compute_dtype, memory_format=fmt)
        for name, b in list(sub.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point():
                sub._buffers[name] = b.to(dtype=plan.compute_dtype, memory_format=_memory_format(b, plan.channels_last))
    return PrecisionResult(plan, before, weight_bytes(module))


@torch.no_grad()
def converted_copy(
    root: nn.Module,
    dtype: torch.dtype,
    part: nn.Module | None = None,
    channels_last: bool = False,
    memo: dict | None = None,
) -> nn.Module:
    """A deep copy of ``root`` whose ``part`` (default: all of ``root``) has its floating-point
    parameters and buffers in ``dtype`` (4-D ones channels-last if asked).

    Each tensor is converted while it is copied, so an unconverted copy never exists.
    ``memo`` pre-seeds ``copy.deepcopy``'s memo, e.g. ``{id(obj): None}`` to leave a
    back-reference out of the copy.
    """
    memo = {} if memo is None else memo
    for p in (part if part is not None else root).parameters():
        if p.is_floating_point():
            memo[id(p)] = nn.Parameter(
                p.detach().to(dtype=dtype, memory_format=_memory_format(p, channels_last)), requires_grad=p.requires_grad
            )
    for b in (part if part is not None else root).buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype=dtype, memory_format=_memory_format(b, channels_last))
    return copy.deepcopy(root, memo)


def _tf32_restorers() -> list[Callable[[], None]]:
    """Callables that put back the current TF32 settings: the legacy ones first (setting them
    also rewrites the per-backend ones), then the per-backend ones exactly as they were.
    torch refuses to read a legacy setting that disagrees with its per-backend one; such a
    setting is left to the per-backend restore."""
    restorers = []
    with contextlib.suppress(RuntimeError):
        restorers.append(functools.partial(torch.set_float32_matmul_precision, torch.get_float32_matmul_precision()))
    with contextlib.suppress(RuntimeError):
        restorers.append(functools.partial(setattr, torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32))
    for path in _FP32_PRECISION_KNOBS:
        obj = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            restorers.append(functools.partial(setattr, obj, "fp32_precision", obj.fp32_precision))
    return restorers


@contextlib.contextmanager
def tf32_scope(enabled: bool = True):
    """Allow (or forbid) TF32 for CUDA matmuls and cuDNN convolutions inside the block.

    Sets ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32`` and
    the float32 matmul precision ("high" or "highest"), and restores every one of these
    process-wide settings on exit, exceptions included. On torch with per-backend
    ``fp32_precision`` settings, "high" also lets oneDNN (CPU) matmuls use TF32 where the
    CPU has it.
    """
    restorers = _tf32_restorers()
    try:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        yield
    finally:
        for restore in restorers:
            restore()


def has_nonfinite(value: Any) -> bool:
    """Whether a tensor, or any tensor in a mapping/list/tuple, holds NaN or Inf."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, Mapping):
        return any(has_nonfinite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_nonfinite(v) for v in value)
    return False


@dataclass(frozen=True)
class GuardedRun:
    """What ``run_with_nan_guard`` returned and did."""

    output: Any
    dtype: torch.dtype
    redone_in: tuple[torch.dtype, ...] = ()
    finite: bool = True

    @property
    def redone(self) -> bool:
        return bool(self.redone_in)

    def describe(self) -> str:
        first = dtype_name(self.dtype)
        if not self.redone:
            return f"finite in {first}" if self.finite else f"NaN/Inf in {first}; nothing safer to redo it in"
        last = dtype_name(self.redone_in[-1])
        return f"NaN/Inf in {first}; redone in {last}" + ("" if self.finite else ", still NaN/Inf")


def run_with_nan_guard(
    run: Callable[[], Any],
    rerun_in: Callable[[torch.dtype], Any],
    dtype: torch.dtype,
    device: torch.device | str,
) -> GuardedRun:
    """Call ``run()`` (which computes in ``dtype`` on ``device``); while its output has NaN/Inf
    and a safer dtype exists (``safe_dtype``: bf16, then fp32), call ``rerun_in(safer)``."""
    output = run()
    redone: list[torch.dtype] = []
    current = dtype
    while has_nonfinite(output) and (safer := safe_dtype(current, device)) is not None:
        output = rerun_in(safer)
        redone.append(safer)
        current = safer
    return GuardedRun(output, dtype, tuple(redone), not has_nonfinite(output))
