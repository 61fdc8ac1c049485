"""The doctor's checks of the device and torch: a kernel run and read back, torch's build and an fp32
conv + matmul against fp64, each dtype stored and computed (bf16, fp16, fp8), and the device a command
names (``usable_device``)."""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import UserError
from .rows import FAILED, OK, UNAVAILABLE, WARN, CheckRow, Context, first_line, gib, package_version, randn, seeded_generator, sync, torch_build

# The oldest torch sdopt declares (pyproject.toml dependencies).
TORCH_FLOOR = (2, 7)
REINSTALL_TORCH = "install a torch build for this device: https://pytorch.org/get-started/locally/ (pip install torch --index-url https://download.pytorch.org/whl/cu128)"


# --- device and torch -----------------------------------------------------------------------------


def _run_on_device(device: torch.device) -> float:
    """A kernel on ``device``: sum of a small elementwise result, read back."""
    x = torch.arange(1024, dtype=torch.float32, device=device)
    value = float((x * 2 + 1).sum())
    sync(device)
    return value


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _free_host_memory() -> int | None:
    from ...optim.device import free_memory

    try:
        return free_memory("cpu")
    except RuntimeError:
        return None


def check_device(ctx: Context) -> list[CheckRow]:
    device = ctx.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        free, total = torch.cuda.mem_get_info(index)
        about = f"{name}, compute capability {major}.{minor}, {gib(free)} free of {gib(total)}"
        if torch.cuda.device_count() > 1:
            about += f" (GPU {index} of {torch.cuda.device_count()})"
    else:
        free = _free_host_memory()
        about = f"CPU {_cpu_name()}, {os.cpu_count()} cores, " + (f"{gib(free)} RAM free" if free else "free RAM unknown")
    tried = f"ran a kernel on {device} and read the result back"
    try:
        value = _run_on_device(device)
    except Exception as error:  # a driver, an architecture torch has no kernels for, ...
        text = first_line(error)
        fix = REINSTALL_TORCH
        if "no kernel image" in text:
            fix = f"this {torch_build()} has no kernels for this GPU's architecture: {REINSTALL_TORCH}"
        return [CheckRow("device", tried, FAILED, f"{about}; the kernel failed: {text}", fix)]
    if value != 1024 * 1024:
        return [CheckRow("device", tried, FAILED, f"{about}; the kernel returned {value}, not {1024 * 1024}",
                         "the device computes wrongly: update the GPU driver and torch")]
    if device.type != "cuda" and torch.version.cuda and not torch.cuda.is_available():
        return [CheckRow("device", tried, WARN, f"{about}; {torch_build()} is built for CUDA but sees no GPU",
                         "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; sdopt runs on the CPU meanwhile")]
    return [CheckRow("device", tried, OK, about)]


def _matmul_and_conv(device: torch.device, dtype: torch.dtype) -> float:
    """Largest error of a small conv + matmul in ``dtype`` on ``device`` against the same in fp64 on
    the CPU, relative to the largest output."""
    generator = seeded_generator()
    x, w, m = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((1, 8, 16, 16), (8, 8, 3, 3), (64, 64)))
    w, m = w / 8, m / 8
    reference = F.conv2d(x, w, padding=1).flatten(1)[:, :64] @ m
    got = F.conv2d(x.to(device, dtype), w.to(device, dtype), padding=1).flatten(1)[:, :64] @ m.to(device, dtype)
    sync(device)
    return float((got.cpu().double() - reference).abs().max() / reference.abs().max())


def check_torch(ctx: Context) -> list[CheckRow]:
    from packaging.version import Version

    versions = [torch_build()]
    if torch.backends.cudnn.is_available():
        versions.append(f"cuDNN {torch.backends.cudnn.version()}")
    triton = package_version("triton") or package_version("triton-windows")
    if triton:
        versions.append(f"Triton {triton}")
    tried = f"an fp32 conv and matmul on {ctx.device} against the same in fp64"
    try:
        error = _matmul_and_conv(ctx.device, torch.float32)
    except Exception as failure:
        return [CheckRow("torch", tried, FAILED, f"{', '.join(versions)}; the conv/matmul failed: {first_line(failure)}", REINSTALL_TORCH)]
    result = f"{', '.join(versions)}; conv + matmul ran (relative error {error:.1e})"
    if Version(torch.__version__).release[:2] < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        return [CheckRow("torch", tried, FAILED, result + f"; sdopt needs torch >= {floor}", f"pip install -U 'torch>={floor}'")]
    return [CheckRow("torch", tried, OK, result)]


# --- precision: storage and compute per dtype -----------------------------------------------------

HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _round_trip(device: torch.device, dtype: torch.dtype) -> float:
    """Largest error of values in [-4, 4] stored in ``dtype`` on ``device`` and read back, relative
    to the value or 1, whichever is larger (below 1 a dtype's steps only get finer)."""
    x = randn(256, device=device).clamp(-4, 4)
    back = x.to(dtype).to(torch.float32)
    sync(device)
    return float(((back - x).abs() / x.abs().clamp_min(1)).max())


def storage_tolerance(dtype: torch.dtype) -> float:
    """Round to nearest is off by at most half a step: half the dtype's epsilon, plus 1%."""
    return torch.finfo(dtype).eps / 2 * 1.01


def _fp8_matmul(device: torch.device) -> float:
    """Relative error of sdopt Precision's fp8 matmul (``fp8_linear``: the activations scaled to e4m3,
    ``fp8_matmul_kernel``) against the same fp8 weights in fp32."""
    from ...optim.precision import fp8_linear

    generator = seeded_generator()
    a = randn(16, 32, device=device, generator=generator)
    b = randn(16, 32, device=device, generator=generator).to(torch.float8_e4m3fn)
    out = fp8_linear(a, b, None, torch.bfloat16)
    reference = a @ b.float().t()
    sync(device)
    return float((out.float() - reference).abs().max() / reference.abs().max())


def _dtype_row(check: str, tried: str, trial: Callable[[], float], unavailable_fix: str, beyond: Callable[[float], str | None],
               wrong_fix: str, measured: str) -> CheckRow:
    """One dtype trial's row: unavailable where ``trial`` raises, failed where ``beyond`` says how far its
    error is out of bounds (None: within them), else ok; ``measured`` names the error."""
    try:
        error = trial()
    except Exception as failure:
        return CheckRow(check, tried, UNAVAILABLE, f"failed: {first_line(failure)}", unavailable_fix)
    result = f"{measured} {error:.1e}"
    out_of_bounds = beyond(error)
    if out_of_bounds:
        return CheckRow(check, tried, FAILED, result + out_of_bounds, wrong_fix)
    return CheckRow(check, tried, OK, result)


def check_dtypes(ctx: Context) -> list[CheckRow]:
    from ...optim.precision import dtype_name, fp8_matmul_emulated, fp8_matmul_kernel

    device, rows = ctx.device, []
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        name, tolerance = dtype_name(dtype), storage_tolerance(dtype)
        rows.append(_dtype_row(f"{name} storage", f"stored 256 values in {name} on {device} and read them back",
                               lambda: _round_trip(device, dtype), f"this {torch_build()} cannot store {name} on {device}: pip install -U torch",
                               lambda error: f" (expected at most {tolerance:.1e})" if error > tolerance else None,
                               "the stored values are wrong: update torch and the GPU driver", "round-trip error"))
    for dtype in (torch.bfloat16, torch.float16):
        name, tolerance = dtype_name(dtype), HALF_TOLERANCE[dtype]
        rows.append(_dtype_row(f"{name} compute", f"a conv + matmul in {name} on {device}, against fp64",
                               lambda: _matmul_and_conv(device, dtype),
                               f"compute in fp32 or the other half dtype (sdopt Precision's auto picks what runs here); for {name}, a newer torch or GPU",
                               lambda error: None if error <= tolerance else f", above {tolerance:.0e}",
                               f"{name} gives wrong numbers here: keep sdopt Precision's compute_dtype at fp32 and update torch and the driver",
                               "relative error"))
    tried = f"sdopt's fp8 e4m3 matmul (activations scaled per call, {fp8_matmul_kernel(device)}) on {device}, against fp32"
    try:
        error = _fp8_matmul(device)
    except Exception as failure:
        capability = ""
        if device.type == "cuda":
            capability = " (this GPU: {}.{})".format(*torch.cuda.get_device_capability(device))
        rows.append(CheckRow("fp8 compute", tried, UNAVAILABLE, f"failed: {first_line(failure)}",
                             f"fp8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell){capability}; "
                             "sdopt Precision's fp8 weight_dtype still halves the weights' memory (stored fp8, computed in fp16/bf16)"))
    else:
        uses = ("on a CPU it checks numbers, it saves no time (ComfyUI runs no fp8 matmul on a CPU)" if fp8_matmul_emulated(device)
                else "ComfyUI's quantized checkpoints use these matmuls")
        rows.append(CheckRow("fp8 compute", tried, OK, f"relative error {error:.1e}; sdopt Precision multiplies fp8_e4m3fn weights "
                                                       f"this way with compute_dtype fp8_matmul; {uses}"))
    return rows


# --- the device a command names -------------------------------------------------------------------


def usable_device(device: torch.device | str, instead: str = "drop --device to check this machine's CPU") -> torch.device:
    """``device`` (a command's ``--device``, or the device ComfyUI or ``default_device`` chose) as a torch
    device, refused where torch cannot parse it or sees no such CUDA device here, ``instead`` saying what
    to do then: doctor's checks or a bench would each fail on it, with a fix for a problem that is not there."""
    try:
        usable = torch.device(device)
    except RuntimeError as error:
        raise UserError(f"--device {device!r} is not a device torch knows ({error}); give e.g. cpu, cuda or cuda:1") from None
    if usable.type == "cpu":
        return usable
    if usable.type != "cuda":
        try:
            torch.empty(1, device=usable)
        except Exception as error:  # each backend refuses its own way: NotImplementedError, AssertionError, ImportError
            raise UserError(f"--device {usable}: torch cannot place a tensor there ({first_line(error)}); {instead}") from None
        return usable
    if not torch.cuda.is_available():
        gpu_build = (f"CUDA {torch.version.cuda}" if torch.version.cuda
                     else f"ROCm {torch.version.hip}" if torch.version.hip else None)
        why = f"built for {gpu_build} but finds no GPU" if gpu_build else "built without CUDA"
        raise UserError(f"--device {usable}: torch sees no CUDA device here (torch {torch.__version__} {why}); {instead}")
    count = torch.cuda.device_count()
    if usable.index is not None and usable.index >= count:
        devices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise UserError(f"--device {usable}: torch sees no such CUDA device here, only {devices}; give one of them or drop --device")
    return usable
