"""``python -m sdopt doctor``: what works on this machine, each tried with one tiny run, and the fix for what does not.

Every check runs its thing (a kernel, a cast, an attention call compared with sdpa, a compile, a
graph capture, a file written into the compile cache), never an import alone, and gives rows: what
was tried, a status, the result, and for anything short of ``ok`` the fix. The rows about sdopt's
nodes ask each technique's own ``unavailable(config, device)`` (``optim.compile``,
``optim.cuda_graph``, ``optim.offload``), the attention registry's checks and ``optim.precision``'s
probes, so they say what the nodes themselves decide here.

ComfyUI is looked at without booting it: its version file and the modules whose APIs sdopt uses
(``load_comfyui``); inside a running ComfyUI (the sdopt Doctor node, ``nodes/doctor.py``) the live
modules are read instead, which also says whether dynamic VRAM is on.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..measure.report import markdown_table
from .memory_mode import server_would_start

OK, WARN, UNAVAILABLE, FAILED = "ok", "warn", "unavailable", "failed"
STATUSES = (OK, WARN, UNAVAILABLE, FAILED)
GIB = 2**30
MIB = 2**20
# The oldest torch sdopt declares (pyproject.toml dependencies).
TORCH_FLOOR = (2, 7)
TRIAL_SEED = 0
ISSUES = "https://github.com/sdopt/sdopt/issues"


@dataclass
class CheckRow:
    """One line of the doctor's table. ``fix`` is required for every status but ``ok``."""

    check: str
    tried: str
    status: str
    result: str
    fix: str = ""
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")
        if self.status != OK and not self.fix:
            raise ValueError(f"{self.check}: a {self.status} row needs a fix")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ComfyInfo:
    """What the doctor knows of ComfyUI. ``dynamic_vram``: None where this ComfyUI has no dynamic
    VRAM, else whether it is on in this process; ``in_server``: read from a running ComfyUI (the
    node) rather than imported by the CLI."""

    path: str | None
    version: str | None = None
    missing_apis: tuple[str, ...] = ()
    dynamic_vram: bool | None = None
    in_server: bool = False
    error: str = ""


@dataclass
class Context:
    device: torch.device
    comfyui: ComfyInfo | None
    rows: dict[str, CheckRow] = field(default_factory=dict)  # by check name: node rows read the trials


# --- small helpers -------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _raised_at(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback, as file:line in function."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "no traceback"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(TRIAL_SEED)


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator or _generator()).to(device, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__}" + (f" (CUDA {cuda})" if cuda else " (no CUDA)")


REINSTALL_TORCH = "install a torch build for this device: https://pytorch.org/get-started/locally/ (pip install torch --index-url https://download.pytorch.org/whl/cu128)"


# --- device and torch ----------------------------------------------------------------------------


def _run_on_device(device: torch.device) -> float:
    """A kernel on ``device``: sum of a small elementwise result, read back."""
    x = torch.arange(1024, dtype=torch.float32, device=device)
    value = float((x * 2 + 1).sum())
    _sync(device)
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
    from ..optim.tiled_vae import free_memory

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
        about = f"{name}, compute capability {major}.{minor}, {_gib(free)} free of {_gib(total)}"
        if torch.cuda.device_count() > 1:
            about += f" (GPU {index} of {torch.cuda.device_count()})"
    else:
        free = _free_host_memory()
        about = f"CPU {_cpu_name()}, {os.cpu_count()} cores, " + (f"{_gib(free)} RAM free" if free else "free RAM unknown")
    tried = f"ran a kernel on {device} and read the result back"
    try:
        value = _run_on_device(device)
    except Exception as error:  # a driver, an architecture torch has no kernels for, ...
        text = _first_line(error)
        fix = REINSTALL_TORCH
        if "no kernel image" in text:
            fix = f"this {_torch_build()} has no kernels for this GPU's architecture: {REINSTALL_TORCH}"
        return [CheckRow("device", tried, FAILED, f"{about}; the kernel failed: {text}", fix)]
    if value != 1024 * 1024:
        return [CheckRow("device", tried, FAILED, f"{about}; the kernel returned {value}, not {1024 * 1024}",
                         "the device computes wrongly: update the GPU driver and torch")]
    if device.type != "cuda" and torch.version.cuda and not torch.cuda.is_available():
        return [CheckRow("device", tried, WARN, f"{about}; {_torch_build()} is built for CUDA but sees no GPU",
                         "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; sdopt runs on the CPU meanwhile")]
    return [CheckRow("device", tried, OK, about)]


def _matmul_and_conv(device: torch.device, dtype: torch.dtype) -> float:
    """Largest error of a small conv + matmul in ``dtype`` on ``device`` against the same in fp64 on
    the CPU, relative to the largest output."""
    generator = _generator()
    x, w, m = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((1, 8, 16, 16), (8, 8, 3, 3), (64, 64)))
    w, m = w / 8, m / 8
    reference = F.conv2d(x, w, padding=1).flatten(1)[:, :64] @ m
    got = F.conv2d(x.to(device, dtype), w.to(device, dtype), padding=1).flatten(1)[:, :64] @ m.to(device, dtype)
    _sync(device)
    return float((got.cpu().double() - reference).abs().max() / reference.abs().max())


def check_torch(ctx: Context) -> list[CheckRow]:
    from packaging.version import Version

    versions = [_torch_build()]
    if torch.backends.cudnn.is_available():
        versions.append(f"cuDNN {torch.backends.cudnn.version()}")
    triton = _package_version("triton") or _package_version("triton-windows")
    if triton:
        versions.append(f"Triton {triton}")
    tried = f"an fp32 conv and matmul on {ctx.device} against the same in fp64"
    try:
        error = _matmul_and_conv(ctx.device, torch.float32)
    except Exception as failure:
        return [CheckRow("torch", tried, FAILED, f"{', '.join(versions)}; the conv/matmul failed: {_first_line(failure)}", REINSTALL_TORCH)]
    result = f"{', '.join(versions)}; conv + matmul ran (relative error {error:.1e})"
    if Version(torch.__version__).release[:2] < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        return [CheckRow("torch", tried, FAILED, result + f"; sdopt needs torch >= {floor}", f"pip install -U 'torch>={floor}'")]
    return [CheckRow("torch", tried, OK, result)]


# --- precision: storage and compute per dtype ----------------------------------------------------

HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _round_trip(device: torch.device, dtype: torch.dtype) -> float:
    """Largest error of values in [-4, 4] stored in ``dtype`` on ``device`` and read back, relative
    to the value or 1, whichever is larger (below 1 a dtype's steps only get finer)."""
    x = _randn(256, device=device).clamp(-4, 4)
    back = x.to(dtype).to(torch.float32)
    _sync(device)
    return float(((back - x).abs() / x.abs().clamp_min(1)).max())


def storage_tolerance(dtype: torch.dtype) -> float:
    """Round to nearest is off by at most half a step: half the dtype's epsilon, plus 1%."""
    return torch.finfo(dtype).eps / 2 * 1.01


def _fp8_matmul(device: torch.device) -> float:
    """Relative error of sdopt Precision's fp8 matmul (``fp8_linear``: the activations scaled to e4m3,
    ``fp8_matmul_kernel``) against the same fp8 weights in fp32."""
    from ..optim.precision import fp8_linear

    generator = _generator()
    a = _randn(16, 32, device=device, generator=generator)
    b = _randn(16, 32, device=device, generator=generator).to(torch.float8_e4m3fn)
    out = fp8_linear(a, b, None, torch.bfloat16)
    reference = a @ b.float().t()
    _sync(device)
    return float((out.float() - reference).abs().max() / reference.abs().max())


def check_dtypes(ctx: Context) -> list[CheckRow]:
    from ..optim.precision import dtype_name, fp8_matmul_emulated, fp8_matmul_kernel

    device, rows = ctx.device, []
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        name = dtype_name(dtype)
        tried = f"stored 256 values in {name} on {device} and read them back"
        try:
            error = _round_trip(device, dtype)
        except Exception as failure:
            rows.append(CheckRow(f"{name} storage", tried, UNAVAILABLE, f"failed: {_first_line(failure)}",
                                 f"this {_torch_build()} cannot store {name} on {device}: pip install -U torch"))
            continue
        if error > storage_tolerance(dtype):
            rows.append(CheckRow(f"{name} storage", tried, FAILED, f"round-trip error {error:.1e} (expected at most {storage_tolerance(dtype):.1e})",
                                 "the stored values are wrong: update torch and the GPU driver"))
        else:
            rows.append(CheckRow(f"{name} storage", tried, OK, f"round-trip error {error:.1e}"))
    for dtype in (torch.bfloat16, torch.float16):
        name = dtype_name(dtype)
        tried = f"a conv + matmul in {name} on {device}, against fp64"
        try:
            error = _matmul_and_conv(device, dtype)
        except Exception as failure:
            rows.append(CheckRow(f"{name} compute", tried, UNAVAILABLE, f"failed: {_first_line(failure)}",
                                 f"compute in fp32 or the other half dtype (sdopt Precision's auto picks what runs here); for {name}, a newer torch or GPU"))
            continue
        if not error <= HALF_TOLERANCE[dtype]:
            rows.append(CheckRow(f"{name} compute", tried, FAILED, f"relative error {error:.1e}, above {HALF_TOLERANCE[dtype]:.0e}",
                                 f"{name} gives wrong numbers here: keep sdopt Precision's compute_dtype at fp32 and update torch and the driver"))
        else:
            rows.append(CheckRow(f"{name} compute", tried, OK, f"relative error {error:.1e}"))
    tried = f"sdopt's fp8 e4m3 matmul (activations scaled per call, {fp8_matmul_kernel(device)}) on {device}, against fp32"
    try:
        error = _fp8_matmul(device)
    except Exception as failure:
        capability = ""
        if device.type == "cuda":
            capability = " (this GPU: {}.{})".format(*torch.cuda.get_device_capability(device))
        rows.append(CheckRow("fp8 compute", tried, UNAVAILABLE, f"failed: {_first_line(failure)}",
                             f"fp8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell){capability}; "
                             "sdopt Precision's fp8 weight_dtype still halves the weights' memory (stored fp8, computed in fp16/bf16)"))
    else:
        uses = ("on a CPU it checks numbers, it saves no time (ComfyUI runs no fp8 matmul on a CPU)" if fp8_matmul_emulated(device)
                else "ComfyUI's quantized checkpoints use these matmuls")
        rows.append(CheckRow("fp8 compute", tried, OK, f"relative error {error:.1e}; sdopt Precision multiplies fp8_e4m3fn weights "
                                                       f"this way with compute_dtype fp8_matmul; {uses}"))
    return rows


# --- attention backends --------------------------------------------------------------------------


def _attention_inputs(device: torch.device) -> tuple[torch.Tensor, ...]:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    generator = _generator()
    return tuple(_randn(1, 2, 128, 64, device=device, dtype=dtype, generator=generator) for _ in range(3))


def _run_attention(name: str, q, k, v) -> torch.Tensor:
    from ..optim.attention import backend_function

    out = backend_function(name)(q, k, v)
    _sync(q.device)
    return out


def _package_fix(backend) -> str:
    top = backend.module.split(".")[0]
    build = f"torch {torch.__version__}" + (f" and CUDA {torch.version.cuda}" if torch.version.cuda else "")
    if importlib.util.find_spec(top) is None:
        return f"pip install {backend.pip} (a build for {build}), or leave it: sdopt Attention falls back to sdpa"
    return (f"its binary does not load with {build}: pip install --force-reinstall {backend.pip} built for this torch "
            f"(or pip uninstall {backend.pip}); sdopt Attention falls back to sdpa meanwhile")


def check_attention(ctx: Context) -> list[CheckRow]:
    from ..optim.attention import backend_names, get_backend

    q, k, v = _attention_inputs(ctx.device)
    dtype_text = str(q.dtype).removeprefix("torch.")
    reference = _run_attention("naive", q, k, v)
    sdpa = _run_attention("sdpa", q, k, v)
    rows = []
    for name in backend_names():
        backend = get_backend(name)
        against = "naive" if name == "sdpa" else "sdpa"
        tried = f"{name} on q, k, v [1, 2, 128, 64] {dtype_text} on {ctx.device}, against {against}"
        imported = backend.check()
        if not imported.ok:
            status = UNAVAILABLE if importlib.util.find_spec(backend.module.split(".")[0]) is None else FAILED
            rows.append(CheckRow(f"attention: {name}", tried, status, imported.reason, _package_fix(backend)))
            continue
        fits = backend.check(ctx.device, q.dtype, q.shape[-1])
        if not fits.ok:
            rows.append(CheckRow(f"attention: {name}", tried, UNAVAILABLE, fits.reason,
                                 f"{name} needs {'an NVIDIA GPU' if 'cuda' in backend.limits else 'other inputs'}; sdopt Attention falls back to sdpa here"))
            continue
        try:
            out = _run_attention(name, q, k, v)
        except Exception as failure:
            fix = _package_fix(backend) if backend.module else f"update torch ({_torch_build()}); sdopt Attention falls back to sdpa meanwhile"
            rows.append(CheckRow(f"attention: {name}", tried, FAILED, f"raised {_first_line(failure)}", fix))
            continue
        expected = reference if name == "sdpa" else sdpa
        error = (out.float() - expected.float()).abs()
        tolerance = backend.tolerance(q.dtype)
        within = bool((error <= tolerance.atol + tolerance.rtol * expected.float().abs()).all())
        result = f"max abs error {float(error.max()):.1e} against {against}"
        if within and backend.low_precision:
            rows.append(CheckRow(f"attention: {name}", tried, OK, result + f" (it quantizes inside by design: within its bound, "
                                 f"{tolerance.describe()}; Attention's auto never picks it, choose {name} by name)"))
        elif within:
            rows.append(CheckRow(f"attention: {name}", tried, OK, result + f" (within {tolerance.describe()})"))
        else:
            rows.append(CheckRow(f"attention: {name}", tried, WARN, result + f", beyond {tolerance.describe()}",
                                 ("" if backend.low_precision else f"sdopt Attention's auto will not pick {name} here; ")
                                 + "choose another backend" + (f", or update {backend.pip}" if backend.pip else "")))
    return rows


# --- inductor and CUDA graphs --------------------------------------------------------------------


def _compile_subject(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w) + x.sin()


def compile_trial(device: torch.device) -> float:
    """Compile ``_compile_subject`` with inductor (a fresh code object, so it really compiles), run
    it, and return its largest difference from eager."""
    from ..optim.compile import with_private_code

    generator = _generator()
    x, w = _randn(8, 32, device=device, generator=generator), _randn(32, 32, device=device, generator=generator)
    compiled = torch.compile(with_private_code(_compile_subject), backend="inductor", fullgraph=True, dynamic=False)
    out = compiled(x, w)
    _sync(device)
    return float((out - _compile_subject(x, w)).abs().max())


def _cpp_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++", "cl"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def check_inductor(ctx: Context) -> list[CheckRow]:
    from ..optim.compile import CompileConfig, unavailable

    device = ctx.device
    generator = f"Triton {_package_version('triton') or _package_version('triton-windows') or '?'}" if device.type == "cuda" else f"the C++ compiler {_cpp_compiler()}"
    tried = f"torch.compile(backend='inductor', fullgraph=True) of a matmul + GELU + sin on {device}, run and compared with eager"
    missing = unavailable(CompileConfig(), device)
    if missing:
        reason, fix, _ = missing
        return [CheckRow("inductor", tried, UNAVAILABLE, reason, fix + " (sdopt Compile: backend aot_eager or eager, or mode trace)")]
    started = time.perf_counter()
    try:
        error = compile_trial(device)
    except Exception as failure:
        if device.type == "cuda":
            fix = f"install the Triton that matches torch {torch.__version__} (pip install -U triton; on Windows: pip install triton-windows)"
        else:
            fix = "install a working C++ compiler (g++ or clang++; on Windows the Visual Studio Build Tools, with cl.exe on PATH)"
        return [CheckRow("inductor", tried, FAILED, f"the compile failed: {_first_line(failure)}",
                         fix + "; meanwhile sdopt Compile runs with backend aot_eager or eager, or mode trace")]
    seconds = time.perf_counter() - started
    if error > 1e-3:
        return [CheckRow("inductor", tried, FAILED, f"compiled code differs from eager by {error:.1e}",
                         "update torch and its compiler (Triton or the C++ compiler); use sdopt Compile's mode trace meanwhile")]
    return [CheckRow("inductor", tried, OK, f"compiled and ran in {seconds:.1f} s with {generator}; max difference from eager {error:.1e}")]


def _capture_backend():
    from ..optim.cuda_graph import CUDACaptureBackend

    return CUDACaptureBackend()


def _graph_trial(device: torch.device) -> float:
    """Capture a matmul + ReLU into a CUDA graph, replay it on new input, and return its largest
    difference from eager."""
    generator = _generator()
    w = _randn(64, 64, device=device, generator=generator)
    static = _randn(16, 64, device=device, generator=generator)

    def subject(x):
        return (x @ w).relu()

    captured = _capture_backend().capture(subject, (static,), 1)
    fresh = _randn(16, 64, device=device, generator=generator)
    static.copy_(fresh)
    captured.replay()
    _sync(device)
    return float((captured.static_output - subject(fresh)).abs().max())


def check_cuda_graph(ctx: Context) -> list[CheckRow]:
    from ..optim.cuda_graph import GraphConfig, unavailable

    tried = f"captured a matmul + ReLU into a CUDA graph on {ctx.device}, replayed it on new input, compared with eager"
    problem = unavailable(GraphConfig(), ctx.device)
    if problem:
        return [CheckRow("CUDA graph", tried, UNAVAILABLE, problem.reason,
                         "needs an NVIDIA GPU and a CUDA build of torch; sdopt CUDA Graph passes the model through here (on_unavailable=fallback)")]
    try:
        error = _graph_trial(ctx.device)
    except Exception as failure:
        return [CheckRow("CUDA graph", tried, FAILED, f"capture or replay failed: {_first_line(failure)}",
                         "update the NVIDIA driver and torch; sdopt CUDA Graph runs eagerly and says so meanwhile")]
    if error > 1e-3:
        return [CheckRow("CUDA graph", tried, FAILED, f"the replay differs from eager by {error:.1e}",
                         "update the NVIDIA driver and torch; do not use sdopt CUDA Graph here")]
    return [CheckRow("CUDA graph", tried, OK, f"captured and replayed; max difference from eager {error:.1e}")]


# --- ComfyUI ---------------------------------------------------------------------------------------

# What sdopt's nodes use, as (description, module, attribute path); each is looked for, never a version.
COMFY_APIS = (
    ("per-model attention override (0.3.60+)", "comfy.ldm.modules.attention", "wrap_attn"),
    ("keyed model wrappers", "comfy.model_patcher", "ModelPatcher.add_wrapper_with_key"),
    ("DIFFUSION_MODEL, OUTER_SAMPLE, SAMPLER_SAMPLE, APPLY_MODEL, PREPARE_SAMPLING wrappers", "comfy.patcher_extension",
     "WrappersMP.DIFFUSION_MODEL WrappersMP.OUTER_SAMPLE WrappersMP.SAMPLER_SAMPLE WrappersMP.APPLY_MODEL WrappersMP.PREPARE_SAMPLING"),
    ("partial loading for sdopt Offload", "comfy.model_patcher", "ModelPatcher.partially_unload ModelPatcher.partially_load"),
)


def _has(module, dotted: str) -> bool:
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def _read_version(path: Path) -> str | None:
    """``__version__`` from ComfyUI's comfyui_version.py, read without importing it."""
    try:
        tree = ast.parse((path / "comfyui_version.py").read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            value = node.value
            return value.value if isinstance(value, ast.Constant) else None
    return None


def comfyui_info(path: str | Path | None, in_server: bool) -> ComfyInfo:
    """What the ComfyUI modules already imported in this process offer."""
    missing = []
    for description, module_name, attributes in COMFY_APIS:
        module = sys.modules.get(module_name)
        if module is None or not all(_has(module, a) for a in attributes.split()):
            missing.append(description)
    memory_management = sys.modules.get("comfy.memory_management")
    dynamic = getattr(memory_management, "aimdo_enabled", None)
    version = _read_version(Path(path)) if path else None
    return ComfyInfo(str(path) if path else None, version, tuple(missing), None if dynamic is None else bool(dynamic), in_server)


def load_comfyui(path: str | Path | None) -> ComfyInfo | None:
    """Import the ComfyUI modules sdopt uses from ``path`` (not the whole server: no nodes are
    loaded), and say what they offer; None without a path."""
    if not path:
        return None
    from .headless import _check_comfyui

    try:
        root = _check_comfyui(Path(path))
    except UserError as error:
        return ComfyInfo(str(path), error=str(error))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    argv = sys.argv
    sys.argv = ["main.py"] + ([] if torch.cuda.is_available() else ["--cpu"])
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        for name in ("comfy.model_management", "comfy.model_patcher", "comfy.patcher_extension", "comfy.ldm.modules.attention"):
            importlib.import_module(name)
        if importlib.util.find_spec("comfy.memory_management") is not None:
            importlib.import_module("comfy.memory_management")
    except Exception as error:  # a broken ComfyUI or its missing requirements
        return ComfyInfo(str(root), _read_version(root), error=_first_line(error))
    finally:
        sys.argv = argv
    return comfyui_info(root, in_server=False)


def comfyui_device() -> torch.device | None:
    """The device ComfyUI's nodes run on, where its model management is imported."""
    model_management = sys.modules.get("comfy.model_management")
    return torch.device(model_management.get_torch_device()) if model_management is not None else None


DYNAMIC_FIX = ("start ComfyUI with --disable-dynamic-vram (sdopt run and the benches: --memory-mode classic) for classic "
               "memory management; sdopt Compile, CUDA Graph and "
               "Offload already run on the model's non-dynamic delegate, and the profiler adds dynamic VRAM's memory to its peak")


def check_comfyui(ctx: Context) -> list[CheckRow]:
    info = ctx.comfyui
    tried = "read ComfyUI's version and looked for the APIs sdopt's nodes use"
    if info is None:
        return [CheckRow("ComfyUI", tried, UNAVAILABLE, "no ComfyUI given",
                         "pass --comfyui /path/to/ComfyUI or set COMFYUI_PATH (inside ComfyUI, the sdopt Doctor node reads it live)")]
    where = f"{info.version or 'version unknown'} at {info.path}"
    if info.error:
        return [CheckRow("ComfyUI", tried, FAILED, f"{where}: {info.error}",
                         "install ComfyUI's requirements into this Python (pip install -r requirements.txt in the ComfyUI folder), or point --comfyui at a working ComfyUI")]
    if info.missing_apis:
        row = CheckRow("ComfyUI", tried, FAILED, f"{where}; missing: {'; '.join(info.missing_apis)}",
                       "update ComfyUI to 0.3.64 or newer (sdopt's requires-comfyui)")
    else:
        row = CheckRow("ComfyUI", tried, OK, f"{where}; every API sdopt uses is there")
    mode_tried = "read ComfyUI's memory mode from comfy.memory_management"
    if info.dynamic_vram is None:
        mode = CheckRow("ComfyUI memory mode", mode_tried, OK, "classic: this ComfyUI has no dynamic VRAM")
    elif info.in_server and info.dynamic_vram:
        mode = CheckRow("ComfyUI memory mode", mode_tried, WARN, "dynamic VRAM (comfy-aimdo) is on: weights are streamed under one global policy", DYNAMIC_FIX)
    elif info.in_server:
        mode = CheckRow("ComfyUI memory mode", mode_tried, OK,
                        "classic: this ComfyUI offers dynamic VRAM, and it is off (a CPU, --disable-dynamic-vram, --highvram, --gpu-only, --novram or an older torch)")
    else:
        would_start, why = server_would_start(ctx.device.type == "cuda")
        if would_start:
            mode = CheckRow("ComfyUI memory mode", mode_tried, WARN,
                            "this ComfyUI offers dynamic VRAM and comfy-aimdo is installed: a server (main.py) on this GPU turns it on by default; "
                            "`python -m sdopt run` and the benches start it the same way (--memory-mode auto)", DYNAMIC_FIX)
        else:
            mode = CheckRow("ComfyUI memory mode", mode_tried, OK, f"classic: this ComfyUI offers dynamic VRAM, which stays off here ({why})")
    return [row, mode]


# --- sdopt's compile cache ---------------------------------------------------------------------------


def _write_probe(folder: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".sdopt-doctor-"):
        pass


def check_compile_cache(ctx: Context) -> list[CheckRow]:
    from ..optim.compile import cache_entries, default_cache_dir, foreign_items, users_cache_dirs

    root = default_cache_dir().expanduser()
    existing = next((p for p in (root, *root.parents) if p.is_dir()), None)
    tried = f"listed sdopt's entries in {root} and wrote a file there"
    try:
        if existing is None:
            raise OSError(f"no folder on the way to {root} exists")
        _write_probe(existing)
    except OSError as error:
        return [CheckRow("compile cache", tried, FAILED, f"{root} cannot be written: {error}",
                         "set SDOPT_CACHE_DIR to a writable folder; until then sdopt Compile compiles cold in every new process")]
    entries = cache_entries(root)
    size = sum(entry["bytes"] for entry in entries)
    result = f"{root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {size / MIB:,.1f} MiB"
    if existing != root:
        result += " (not created yet; its parent is writable)"
    foreign = foreign_items(root)
    if foreign:
        result += f"; {len(foreign)} other item(s) there, which `cache purge` leaves alone"
    for variable, value in users_cache_dirs().items():
        result += f"; your {variable}={value} holds torch's caches instead"
    return [CheckRow("compile cache", tried, OK, result + "; `python -m sdopt cache list|purge`")]


# --- what each sdopt node would run here -------------------------------------------------------------


def _node_row(node: str, runs: list[str], cannot: dict[str, str], fix: str, tried: str) -> CheckRow:
    """ok when nothing is missing, warn when some modes cannot run, unavailable when none can."""
    result = ("runs: " + ", ".join(runs)) if runs else "runs nothing here"
    if cannot:
        result += "; cannot: " + "; ".join(f"{mode} ({why})" for mode, why in cannot.items())
    status = OK if not cannot else (WARN if runs else UNAVAILABLE)
    return CheckRow(f"node: {node}", tried, status, result, fix if status != OK else "")


def _trial_failed(ctx: Context, check: str) -> str:
    row = ctx.rows.get(check)
    return "" if row is None or row.status == OK else f"the {check} trial: {row.result}"


def _precision_rows(ctx: Context) -> list[CheckRow]:
    from ..optim.precision import COMPUTE_DTYPES, DTYPES, FP8_MATMUL, compute_supported, fp8_matmul_supported, pick_dtype

    device = ctx.device
    pick = pick_dtype(device)
    compute = [name for name in COMPUTE_DTYPES if compute_supported(DTYPES[name], device)]
    cannot = {f"compute_dtype {name}": f"does not run on {device}" for name in COMPUTE_DTYPES if name not in compute}
    runs = [f"auto → {str(pick.dtype).removeprefix('torch.')} ({pick.reason})", "weight_dtype fp32/fp16/bf16/fp8 (fp8 stored, upcast per layer)",
            f"compute_dtype {'/'.join(compute)}", "channels_last"]
    if fp8_matmul_supported(device):
        runs.append(f"compute_dtype {FP8_MATMUL} (with weight_dtype fp8_e4m3fn)")
    else:
        cannot[f"compute_dtype {FP8_MATMUL}"] = f"torch._scaled_mm does not run on {device}"
    tf32 = torch.cuda.get_device_capability(device)[0] >= 8 if device.type == "cuda" else False
    if tf32:
        runs.append("tf32")
    else:
        cannot["tf32"] = "a CUDA setting of Ampere and newer GPUs: no effect here"
    tried = "optim.precision: pick_dtype (auto) and compute_supported per compute dtype"
    precision = _node_row("sdopt Precision", runs, cannot, "use the modes listed as running; the others need an NVIDIA GPU (tf32: Ampere or newer; fp8_matmul: compute capability 8.9 or newer)", tried)
    vae_cannot = {k: v for k, v in cannot.items() if k.startswith("compute_dtype")}
    vae = _node_row("sdopt VAE Precision", [f"auto → {str(pick.dtype).removeprefix('torch.')}", f"dtype {'/'.join(compute)}", "nan_guard"],
                    {k.replace("compute_dtype", "dtype"): v for k, v in vae_cannot.items()},
                    "use a dtype listed as running", tried)
    return [precision, vae]


def _attention_rows(ctx: Context) -> list[CheckRow]:
    from ..optim.attention import backend_names, get_backend

    runs, cannot = [], {}
    for name in backend_names():
        verdict = get_backend(name).check(ctx.device)
        row = ctx.rows.get(f"attention: {name}")
        if verdict.ok and (row is None or row.status in (OK, WARN)):
            runs.append(name)
        else:
            cannot[name] = verdict.reason or (row.result if row else "")
    runs.insert(0, "auto")
    tried = "the attention registry's availability check of every backend on this device"
    rows = [_node_row("sdopt Attention", runs, cannot, "see the attention rows above for each backend's fix; auto and named backends fall back to sdpa", tried),
            _node_row("sdopt VAE Attention", runs, cannot, "see the attention rows above for each backend's fix", tried)]
    info = ctx.comfyui
    if info is not None and not info.error and any("attention override" in api for api in info.missing_apis):
        rows[0] = CheckRow("node: sdopt Attention", tried, UNAVAILABLE, "this ComfyUI has no per-model attention override",
                           "update ComfyUI to 0.3.60 or newer; until then the node passes the model through (on_unavailable=fallback)")
    return rows


def _compile_row(ctx: Context) -> CheckRow:
    from ..optim.compile import BACKENDS, CompileConfig, unavailable

    backends, cannot, fixes = [], {}, []
    inductor_failed = _trial_failed(ctx, "inductor")
    for backend in BACKENDS:
        missing = unavailable(CompileConfig(backend=backend), ctx.device)
        if missing:
            cannot[f"backend {backend}"] = missing[0]
            fixes.append(missing[1])
        elif backend == "inductor" and inductor_failed:
            cannot[f"backend {backend}"] = inductor_failed
            fixes.append("see the inductor row's fix")
        else:
            backends.append(backend)
    runs = [f"compile and compile_regional with {', '.join(backends)}"] if backends else []
    runs.append("trace")
    return _node_row("sdopt Compile", runs, cannot, "; ".join(dict.fromkeys(fixes)),
                     "optim.compile.unavailable for every backend, and the inductor trial")


def _graph_and_offload_rows(ctx: Context) -> list[CheckRow]:
    from ..optim.cuda_graph import GraphConfig, unavailable as graph_unavailable
    from ..optim.offload import MODES as OFFLOAD_MODES, OffloadConfig, unavailable as offload_unavailable

    problem = graph_unavailable(GraphConfig(), ctx.device)
    reason = (problem.reason if problem else None) or _trial_failed(ctx, "CUDA graph")
    graph = _node_row("sdopt CUDA Graph", [] if reason else ["capture and replay per input signature"], {"CUDA graphs": reason} if reason else {},
                      "needs an NVIDIA GPU; with on_unavailable=fallback the node passes the model through",
                      "optim.cuda_graph.unavailable and the capture trial")
    problem = offload_unavailable(OffloadConfig(), ctx.device)
    reason = problem.reason if problem else None
    offload = _node_row("sdopt Offload", [] if reason else list(OFFLOAD_MODES), {"every mode": reason} if reason else {},
                        "needs a GPU: on a CPU the weights are already in RAM; with on_unavailable=fallback the node passes the model through",
                        "optim.offload.unavailable for this device")
    return [graph, offload]


def _always_rows(ctx: Context) -> list[CheckRow]:
    from ..optim.tiled_vae import free_memory

    memory = "VRAM" if ctx.device.type == "cuda" else "RAM"
    budget = free_memory(ctx.device)
    rows = [
        _node_row("sdopt Tiled VAE", [f"tiled decode/encode, auto tile from {_gib(budget)} free {memory}"], {}, "", "optim.tiled_vae.free_memory on this device"),
        _node_row("sdopt Low Memory", ["sequential cfg, chunked GroupNorm/conv/feed-forward (those the model has), low_memory attention"], {}, "", "nothing to check: torch only"),
        _node_row("sdopt Step Cache", ["deepcache on UNets (SD1.5, SDXL), alone or under Compile and CUDA Graph",
                                       "first_block on diffusion transformers (SD3.5, Flux), beside regional Compile"], {}, "",
                  "nothing to check: torch only; the model decides (deepcache: a UNet with down, middle and up blocks; "
                  "first_block: a chain of transformer blocks)"),
    ]
    chart = importlib.util.find_spec("matplotlib") is not None
    rows.append(_node_row("sdopt Profiler", [f"step times, steady it/s, peak {memory}"], {}, "", "nothing to check: torch only"))
    rows.append(_node_row("sdopt Profile Report", ["table and JSON"] + (["chart"] if chart else []), {} if chart else {"chart": "matplotlib is not installed"},
                          "pip install matplotlib", "looked for matplotlib"))
    return rows


def _one(row_of: Callable[[Context], CheckRow]) -> Callable[[Context], list[CheckRow]]:
    return lambda ctx: [row_of(ctx)]


# Each its own check, so that a fault in one costs that check's rows, not every node's.
NODE_CHECKS: tuple[tuple[str, Callable[[Context], list[CheckRow]]], ...] = (
    ("node: sdopt Precision and VAE Precision", _precision_rows),
    ("node: sdopt Attention and VAE Attention", _attention_rows),
    ("node: sdopt Compile", _one(_compile_row)),
    ("node: sdopt CUDA Graph and Offload", _graph_and_offload_rows),
    ("node: the torch-only nodes", _always_rows),
)


def check_nodes(ctx: Context) -> list[CheckRow]:
    return [row for _, check in NODE_CHECKS for row in check(ctx)]


# --- running the checks ----------------------------------------------------------------------------

CHECKS: tuple[tuple[str, Callable[[Context], list[CheckRow]]], ...] = (
    ("device", check_device),
    ("torch", check_torch),
    ("precision", check_dtypes),
    ("attention", check_attention),
    ("inductor", check_inductor),
    ("CUDA graph", check_cuda_graph),
    ("ComfyUI", check_comfyui),
    ("compile cache", check_compile_cache),
    *NODE_CHECKS,
)


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
            raise UserError(f"--device {usable}: torch cannot place a tensor there ({_first_line(error)}); {instead}") from None
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


def run_checks(device: torch.device | str, comfyui: ComfyInfo | None = None,
               progress: Callable[[str], None] | None = None) -> list[CheckRow]:
    """Every check, in order, on ``usable_device(device)``; a check that raises becomes one failed
    row, and the others still run."""
    ctx = Context(usable_device(device), comfyui)
    rows = []
    for name, check in CHECKS:
        if progress is not None:
            progress(name)
        started = time.perf_counter()
        try:
            found = check(ctx)
        except Exception as error:
            found = [CheckRow(name, f"the {name} check", FAILED, f"the check itself raised {_first_line(error)} ({_raised_at(error)})",
                              f"report it at {ISSUES} with this table")]
        seconds = (time.perf_counter() - started) / len(found)
        for row in found:
            row.seconds = round(seconds, 3)
            ctx.rows[row.check] = row
        rows.extend(found)
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def doctor_table(rows: list[CheckRow]) -> str:
    body = [[_cell(r.check), r.status, _cell(r.result), _cell(r.fix) or "—", _cell(r.tried)] for r in rows]
    return "\n".join(markdown_table(["check", "status", "result", "fix", "tried"], body))


def summary(rows: list[CheckRow], seconds: float | None = None) -> str:
    counts = {status: sum(r.status == status for r in rows) for status in STATUSES}
    text = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    return text + (f"; took {seconds:.1f} s" if seconds is not None else "")


def default_device(comfyui: ComfyInfo | None) -> torch.device:
    """ComfyUI's device where its model management was imported, else CUDA when present, else the CPU."""
    if comfyui is not None and not comfyui.error:
        device = comfyui_device()
        if device is not None:
            return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
