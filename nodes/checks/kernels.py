"""The doctor's kernel trials: every registered attention backend on a small q, k, v against sdpa (sdpa
against naive), an inductor compile of a tiny function against eager, and a CUDA graph capture replayed
on new input."""
from __future__ import annotations

import importlib.util
import os
import shutil
import time

import torch
import torch.nn.functional as F

from .rows import FAILED, OK, UNAVAILABLE, WARN, CheckRow, Context, first_line, package_version, randn, seeded_generator, sync, torch_build


# --- attention backends ---------------------------------------------------------------------------


def _attention_inputs(device: torch.device) -> tuple[torch.Tensor, ...]:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    generator = seeded_generator()
    return tuple(randn(1, 2, 128, 64, device=device, dtype=dtype, generator=generator) for _ in range(3))


def _run_attention(name: str, q, k, v) -> torch.Tensor:
    from ...optim.attention import backend_function

    out = backend_function(name)(q, k, v)
    sync(q.device)
    return out


def _package_fix(backend) -> str:
    top = backend.module.split(".")[0]
    build = f"torch {torch.__version__}" + (f" and CUDA {torch.version.cuda}" if torch.version.cuda else "")
    if importlib.util.find_spec(top) is None:
        return f"pip install {backend.pip} (a build for {build}), or leave it: sdopt Attention falls back to sdpa"
    return (f"its binary does not load with {build}: pip install --force-reinstall {backend.pip} built for this torch "
            f"(or pip uninstall {backend.pip}); sdopt Attention falls back to sdpa meanwhile")


def check_attention(ctx: Context) -> list[CheckRow]:
    from ...optim.attention import backend_names, get_backend

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
            fix = _package_fix(backend) if backend.module else f"update torch ({torch_build()}); sdopt Attention falls back to sdpa meanwhile"
            rows.append(CheckRow(f"attention: {name}", tried, FAILED, f"raised {first_line(failure)}", fix))
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


# --- inductor and CUDA graphs ---------------------------------------------------------------------


def _compile_subject(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w) + x.sin()


def compile_trial(device: torch.device) -> float:
    """Compile ``_compile_subject`` with inductor (a fresh code object, so it really compiles), run
    it, and return its largest difference from eager."""
    from ...optim.compile import with_private_code

    generator = seeded_generator()
    x, w = randn(8, 32, device=device, generator=generator), randn(32, 32, device=device, generator=generator)
    compiled = torch.compile(with_private_code(_compile_subject), backend="inductor", fullgraph=True, dynamic=False)
    out = compiled(x, w)
    sync(device)
    return float((out - _compile_subject(x, w)).abs().max())


def _cpp_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++", "cl"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def check_inductor(ctx: Context) -> list[CheckRow]:
    from ...optim.compile import CompileConfig, unavailable

    device = ctx.device
    generator = f"Triton {package_version('triton') or package_version('triton-windows') or '?'}" if device.type == "cuda" else f"the C++ compiler {_cpp_compiler()}"
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
        return [CheckRow("inductor", tried, FAILED, f"the compile failed: {first_line(failure)}",
                         fix + "; meanwhile sdopt Compile runs with backend aot_eager or eager, or mode trace")]
    seconds = time.perf_counter() - started
    if error > 1e-3:
        return [CheckRow("inductor", tried, FAILED, f"compiled code differs from eager by {error:.1e}",
                         "update torch and its compiler (Triton or the C++ compiler); use sdopt Compile's mode trace meanwhile")]
    return [CheckRow("inductor", tried, OK, f"compiled and ran in {seconds:.1f} s with {generator}; max difference from eager {error:.1e}")]


def _capture_backend():
    from ...optim.cuda_graph import CUDACaptureBackend

    return CUDACaptureBackend()


def _graph_trial(device: torch.device) -> float:
    """Capture a matmul + ReLU into a CUDA graph, replay it on new input, and return its largest
    difference from eager."""
    generator = seeded_generator()
    w = randn(64, 64, device=device, generator=generator)
    static = randn(16, 64, device=device, generator=generator)

    def subject(x):
        return (x @ w).relu()

    captured = _capture_backend().capture(subject, (static,), 1)
    fresh = randn(16, 64, device=device, generator=generator)
    static.copy_(fresh)
    captured.replay()
    sync(device)
    return float((captured.static_output - subject(fresh)).abs().max())


def check_cuda_graph(ctx: Context) -> list[CheckRow]:
    from ...optim.cuda_graph import GraphConfig, unavailable

    tried = f"captured a matmul + ReLU into a CUDA graph on {ctx.device}, replayed it on new input, compared with eager"
    problem = unavailable(GraphConfig(), ctx.device)
    if problem:
        return [CheckRow("CUDA graph", tried, UNAVAILABLE, problem.reason,
                         "needs an NVIDIA GPU and a CUDA build of torch; sdopt CUDA Graph passes the model through here (on_unavailable=fallback)")]
    try:
        error = _graph_trial(ctx.device)
    except Exception as failure:
        return [CheckRow("CUDA graph", tried, FAILED, f"capture or replay failed: {first_line(failure)}",
                         "update the NVIDIA driver and torch; sdopt CUDA Graph runs eagerly and says so meanwhile")]
    if error > 1e-3:
        return [CheckRow("CUDA graph", tried, FAILED, f"the replay differs from eager by {error:.1e}",
                         "update the NVIDIA driver and torch; do not use sdopt CUDA Graph here")]
    return [CheckRow("CUDA graph", tried, OK, f"captured and replayed; max difference from eager {error:.1e}")]
