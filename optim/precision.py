"""Precision: weight storage dtype, compute dtype, TF32, channels-last, and a NaN guard.

Host-independent. ``plan_precision`` resolves a ``PrecisionConfig`` for a model on a device
(``pick_dtype`` says what ``auto`` means there, measured where it matters), and
``converted_copy`` makes the private copy of a module whose weights are stored in the planned
dtype; the host computes in the planned compute dtype (ComfyUI: its per-layer cast, which also
upcasts fp8 storage), or, with ``fp8_matmul``, multiplies fp8 e4m3 weights in fp8 (``fp8_linear``:
``torch._scaled_mm`` with a per-call activation scale; on a CPU, its fp32 emulation written out).
Nothing here changes the module it is given.

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
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
WEIGHT_DTYPES = tuple(DTYPES)
AUTO = "auto"
COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
FP8_MATMUL = "fp8_matmul"
# e4m3's largest finite value: an activation is scaled so that its largest magnitude lands there.
E4M3_MAX = 448.0
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


def fp8_linear_fits(features: int, outputs: int) -> bool:
    """Whether ``fp8_linear`` multiplies a layer of these widths in fp8: ``_scaled_mm`` wants multiples of 16."""
    return features % 16 == 0 and outputs % 16 == 0


def fp8_matmul_emulated(device: torch.device | str) -> bool:
    """Whether ``fp8_linear`` computes its products as ``torch._scaled_mm``'s fp32 emulation on
    ``device`` instead of calling it: on a CPU, which has no fp8 unit."""
    return torch.device(device).type == "cpu"


def fp8_matmul_kernel(device: torch.device | str) -> str:
    """What multiplies ``fp8_linear``'s products on ``device``, as records name it."""
    return "torch._scaled_mm's fp32 emulation (a CPU has no fp8 unit)" if fp8_matmul_emulated(device) else "torch._scaled_mm"


def _fp8_product(quantized: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    if not fp8_matmul_emulated(quantized.device):
        one = torch.ones((), device=quantized.device, dtype=torch.float32)
        return torch._scaled_mm(quantized, weight.t(), scale_a=scale, scale_b=one, out_dtype=out_dtype, bias=bias)
    # torch's own CPU _scaled_mm computes this same product in fp32 (equal to the bit), but on a CPU
    # with AMX it hands it to oneDNN's fp8 reference kernel instead: 300x slower at 512x128x128 and
    # 1,400x at 2048x256x1024 (a 2-core Xeon with AMX and AVX512-FP16, torch 2.14). Written out, it
    # also stays fast inside a compiled graph.
    out = (quantized.float() * scale) @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``x @ weight.T + bias`` with ``weight`` stored fp8 e4m3 (scale 1, as ComfyUI stores fp8 and
    patches LoRAs into it) and ``x`` quantized to e4m3 with one scale per call (its largest magnitude
    at ``E4M3_MAX``, where ComfyUI's fp8 fast path clamps at it), multiplied by ``fp8_matmul_kernel``
    into ``out_dtype``. None where ``fp8_linear_fits`` says no (the caller computes it as before); for
    ``_scaled_mm`` the rows are padded to a multiple of 16."""
    features, outputs = x.shape[-1], weight.shape[0]
    if not fp8_linear_fits(features, outputs):
        return None
    rows = x.reshape(-1, features)
    padded = 0 if fp8_matmul_emulated(rows.device) else -rows.shape[0] % 16
    if padded:
        rows = F.pad(rows, (0, 0, 0, padded))
    scale = (rows.abs().amax().float() / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = (rows.float() / scale).to(torch.float8_e4m3fn)
    out = _fp8_product(quantized, weight, scale, None if bias is None else bias.to(out_dtype), out_dtype)
    return out[: out.shape[0] - padded].reshape(*x.shape[:-1], outputs)


@functools.lru_cache(maxsize=None)
def fp8_matmul_supported(device: torch.device | str) -> bool:
    """Whether ``fp8_linear`` multiplies e4m3 matrices on ``device`` (tried once)."""
    device = torch.device(device)
    try:
        x = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
        out = fp8_linear(x, torch.ones(16, 16, device=device).to(torch.float8_e4m3fn), None, torch.bfloat16)
        return bool(torch.isfinite(out).all())
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False


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
class AutoPick:
    """The dtype ``auto`` resolved to on a device, and why."""

    dtype: torch.dtype
    reason: str


# bf16 must beat fp32 by this much on the probe: a tie is not worth the precision it costs.
BF16_FASTER_BELOW = 0.9


def _probe_once(device: torch.device, dtype: torch.dtype, side: int = 32) -> float:
    """Seconds of one UNet-shaped conv (128 channels, ``side``²) and matmul (``side``² tokens, 320→1280)
    in ``dtype``, CUDA synchronized."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, side, side, generator=generator).to(device, dtype)
    w = torch.randn(128, 128, 3, 3, generator=generator).to(device, dtype) / 32
    tokens = torch.randn(side * side, 320, generator=generator).to(device, dtype)
    features = torch.randn(320, 1280, generator=generator).to(device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    F.conv2d(x, w, padding=1)
    tokens @ features
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@functools.lru_cache(maxsize=None)
def _bf16_over_fp32(device: str) -> float:
    """bf16's time over fp32's on the probe.

    A small probe first: CPUs without bf16 kernels run it 30 to 130 times slower than fp32 (seconds
    at full size), and 20 times is answer enough. Otherwise the fastest of 5 interleaved full-size
    rounds after a warm-up of each, since interference only ever adds time.
    """
    dev = torch.device(device)
    _probe_once(dev, torch.float32, side=8)
    small_fp32 = _probe_once(dev, torch.float32, side=8)
    small_bf16 = _probe_once(dev, torch.bfloat16, side=8)
    if small_bf16 > 20 * small_fp32:
        return small_bf16 / small_fp32
    _probe_once(dev, torch.float32)
    _probe_once(dev, torch.bfloat16)
    fp32, bf16 = [], []
    for _ in range(5):
        fp32.append(_probe_once(dev, torch.float32))
        bf16.append(_probe_once(dev, torch.bfloat16))
    return min(bf16) / min(fp32)


HALF_DTYPES = (torch.float16, torch.bfloat16)


def pick_dtype(device: torch.device | str, allowed: tuple[torch.dtype, ...] | None = None) -> AutoPick:
    """What ``auto`` means on ``device`` for a model that runs in ``allowed``, its preferred dtype first
    (ComfyUI's ``supported_inference_dtypes``: bf16 first for a model whose activations overflow fp16);
    None: fp16, bf16 or fp32.

    On CUDA: the first half dtype in ``allowed`` that runs there. Elsewhere bf16, where allowed and
    measured faster than fp32 (``BF16_FASTER_BELOW``), else fp32."""
    device = torch.device(device)
    halves = [dtype for dtype in allowed or HALF_DTYPES if dtype in HALF_DTYPES]
    if device.type == "cuda":
        dtype = next((dtype for dtype in halves if compute_supported(dtype, device)), None)
        if dtype is None:
            tried = " or ".join(dtype_name(dtype) for dtype in halves)
            return AutoPick(torch.float32, f"{tried} does not run on {device}" if halves else "this model runs in fp32 only")
        why = "half the memory of fp32 and tensor-core kernels"
        if dtype != halves[0]:
            why += f" ({dtype_name(halves[0])}, which this model prefers, does not run on {device})"
        elif dtype != torch.float16:
            why = f"the half dtype this model prefers, {why}"
        return AutoPick(dtype, f"{dtype_name(dtype)} on CUDA: {why}")
    if torch.bfloat16 not in halves:
        return AutoPick(torch.float32, "fp32: this model does not run in bf16")
    if not compute_supported(torch.bfloat16, device):
        return AutoPick(torch.float32, f"bf16 does not run on {device}")
    ratio = _bf16_over_fp32(str(device))
    measured = f"a conv+matmul probe took {ratio:.2f}x the fp32 time in bf16 on this {device.type}"
    if ratio < BF16_FASTER_BELOW:
        return AutoPick(torch.bfloat16, measured)
    return AutoPick(torch.float32, measured + ", so fp32")


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
        if self.compute_dtype is not None and self.compute_dtype != FP8_MATMUL:
            parse_dtype(self.compute_dtype, "compute_dtype", COMPUTE_DTYPES)


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes that will actually be used, resolved for one module on one device."""

    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    tf32: bool
    channels_last: bool
    fp8_matmul: bool = False

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
    model keeps computing as it does now. ``fp8_matmul``: fp8 e4m3 weights multiplied in fp8 where
    ``fp8_matmul_supported``, everything else computed in bf16 on CUDA (else fp16), elsewhere in fp32
(CPUs mostly emulate bf16, and fp8 matmuls are for GPUs: on a CPU the mode is there to check numbers).
    """
    weight = DTYPES[config.weight_dtype] if config.weight_dtype else stored
    if config.compute_dtype == FP8_MATMUL:
        if weight != torch.float8_e4m3fn:
            raise UserError(f"compute_dtype: {FP8_MATMUL} multiplies fp8_e4m3fn weights, and these are {dtype_name(weight)}: "
                            "set weight_dtype to fp8_e4m3fn")
        if not fp8_matmul_supported(device):
            raise UserError(f"compute_dtype: {FP8_MATMUL}: torch._scaled_mm does not run on {torch.device(device)} (fp8 matmuls "
                            "need an NVIDIA GPU of compute capability 8.9 or newer); choose bf16 or fp16, which keeps the fp8 "
                            "weights' memory saving")
        rest = torch.float32
        if torch.device(device).type == "cuda":
            rest = next((d for d in (torch.bfloat16, torch.float16) if compute_supported(d, device)), torch.float32)
        return PrecisionPlan(weight, rest, config.tf32, config.channels_last, fp8_matmul=True)
    if config.compute_dtype:
        compute = DTYPES[config.compute_dtype]
        check_compute_dtype(compute, device, "compute_dtype")
    elif config.weight_dtype and compute_supported(weight, device):
        compute = weight
    else:
        compute = computing if compute_supported(computing, device) else torch.float32
    return PrecisionPlan(weight, compute, config.tf32, config.channels_last)


def weight_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``module``'s parameters as stored, or with every floating-point one stored in ``dtype``."""
    return sum(
        p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
        for p in module.parameters()
    )


def _memory_format(t: torch.Tensor, channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last and t.ndim == 4 else torch.preserve_format


@torch.no_grad()
def converted_copy(module: nn.Module, dtype: torch.dtype, channels_last: bool = False,
                   leave_out: Collection[str] = ()) -> nn.Module:
    """A deep copy of ``module`` with its floating-point parameters and buffers in ``dtype``
    (4-D ones channels-last if asked); ``module`` is left as it is.

    Each tensor is converted while it is copied, so an unconverted copy never exists. The copy's
    parameters never require grad: ComfyUI's weight patches (LoRAs) write parameters that do not,
    and a compiled model guards on the flag, so a differing one would recompile on every LoRA.
    Instance attributes named in ``leave_out`` (state a host keeps on the original's modules, such as
    a memory manager's buffers) are not on the copy's modules, where the class's defaults show again:
    their values are neither shared nor copied.
    """
    memo = {}
    for p in module.parameters():
        if p.is_floating_point():
            memo[id(p)] = nn.Parameter(
                p.detach().to(dtype=dtype, memory_format=_memory_format(p, channels_last), copy=True),
                requires_grad=False,
            )
    for b in module.buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype=dtype, memory_format=_memory_format(b, channels_last), copy=True)
    originals = list(module.modules())
    held = [(index, name) for index, m in enumerate(originals) for name in leave_out if name in vars(m)]
    for index, name in held:
        value = vars(originals[index])[name]
        if not isinstance(value, _ATOMS):  # an atom's id is shared by every use of it
            memo[id(value)] = None
    copied = copy.deepcopy(module, memo)
    copies = list(copied.modules())
    for index, name in held:
        del vars(copies[index])[name]
    return copied


_ATOMS = (bool, int, float, str, bytes, type(None))


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
