"""The doctor's rows about sdopt's nodes: what each registered node (``nodes/registry.py``) would run on this
device, asking each technique's own ``unavailable(config, device)`` (``optim.compile``, ``optim.cuda_graph``,
``optim.offload``), the attention registry's checks and ``optim.precision``'s probes, and reading the trials
run before them (``Context.rows``), so that the rows say what the nodes themselves decide here.

``NODE_ROWS`` maps each registered node's class name to its row builder; ``require_rows`` names every
registered node without one.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable

import torch

from .rows import OK, UNAVAILABLE, WARN, CheckRow, Context, gib

RowBuilder = Callable[[Context], CheckRow]


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


# --- Precision and VAE Precision ------------------------------------------------------------------

PRECISION_TRIED = "optim.precision: pick_dtype (auto) and compute_supported per compute dtype"


def _precision_modes(device: torch.device):
    """``pick_dtype``'s pick (probed once, then cached), the compute dtypes that run on ``device``, and why
    the other compute dtypes (fp8_matmul too) do not."""
    from ...optim.precision import COMPUTE_DTYPES, DTYPES, FP8_MATMUL, compute_supported, fp8_matmul_supported, pick_dtype

    pick = pick_dtype(device)
    compute = [name for name in COMPUTE_DTYPES if compute_supported(DTYPES[name], device)]
    cannot = {f"compute_dtype {name}": f"does not run on {device}" for name in COMPUTE_DTYPES if name not in compute}
    if not fp8_matmul_supported(device):
        cannot[f"compute_dtype {FP8_MATMUL}"] = f"torch._scaled_mm does not run on {device}"
    return pick, compute, cannot


def _precision_row(ctx: Context) -> CheckRow:
    from ...optim.precision import FP8_MATMUL, fp8_matmul_supported

    device = ctx.device
    pick, compute, cannot = _precision_modes(device)
    runs = [f"auto → {str(pick.dtype).removeprefix('torch.')} ({pick.reason})", "weight_dtype fp32/fp16/bf16/fp8 (fp8 stored, upcast per layer)",
            f"compute_dtype {'/'.join(compute)}", "channels_last"]
    if fp8_matmul_supported(device):
        runs.append(f"compute_dtype {FP8_MATMUL} (with weight_dtype fp8_e4m3fn)")
    tf32 = torch.cuda.get_device_capability(device)[0] >= 8 if device.type == "cuda" else False
    if tf32:
        runs.append("tf32")
    else:
        cannot["tf32"] = "a CUDA setting of Ampere and newer GPUs: no effect here"
    return _node_row("sdopt Precision", runs, cannot,
                     "use the modes listed as running; the others need an NVIDIA GPU (tf32: Ampere or newer; fp8_matmul: compute capability 8.9 or newer)",
                     PRECISION_TRIED)


def _vae_precision_row(ctx: Context) -> CheckRow:
    pick, compute, cannot = _precision_modes(ctx.device)
    return _node_row("sdopt VAE Precision", [f"auto → {str(pick.dtype).removeprefix('torch.')}", f"dtype {'/'.join(compute)}", "nan_guard"],
                     {k.replace("compute_dtype", "dtype"): v for k, v in cannot.items()},
                     "use a dtype listed as running", PRECISION_TRIED)


# --- Attention and VAE Attention ------------------------------------------------------------------

ATTENTION_TRIED = "the attention registry's availability check of every backend on this device"


def _attention_modes(ctx: Context) -> tuple[list[str], dict[str, str]]:
    """The backends that run here (``auto`` first), and why the others do not: the registry's check, or
    the failed trial in the attention rows above."""
    from ...optim.attention import backend_names, get_backend

    runs, cannot = [], {}
    for name in backend_names():
        verdict = get_backend(name).check(ctx.device)
        row = ctx.rows.get(f"attention: {name}")
        if verdict.ok and (row is None or row.status in (OK, WARN)):
            runs.append(name)
        else:
            cannot[name] = verdict.reason or (row.result if row else "")
    runs.insert(0, "auto")
    return runs, cannot


def _attention_row(ctx: Context) -> CheckRow:
    info = ctx.comfyui
    if info is not None and not info.error and any("attention override" in api for api in info.missing_apis):
        return CheckRow("node: sdopt Attention", ATTENTION_TRIED, UNAVAILABLE, "this ComfyUI has no per-model attention override",
                        "update ComfyUI to 0.3.60 or newer; until then the node passes the model through (on_unavailable=fallback)")
    return _node_row("sdopt Attention", *_attention_modes(ctx),
                     "see the attention rows above for each backend's fix; auto and named backends fall back to sdpa", ATTENTION_TRIED)


def _vae_attention_row(ctx: Context) -> CheckRow:
    return _node_row("sdopt VAE Attention", *_attention_modes(ctx), "see the attention rows above for each backend's fix", ATTENTION_TRIED)


# --- Compile, CUDA Graph, Offload -----------------------------------------------------------------


def _compile_row(ctx: Context) -> CheckRow:
    from ...optim.compile import BACKENDS, MODE_OBJECTS, CompileConfig, unavailable

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
    by_backend = [mode.name for mode in MODE_OBJECTS.values() if mode.compiles_with_dynamo]
    runs = [f"{' and '.join(by_backend)} with {', '.join(backends)}"] if backends else []
    runs += [mode.name for mode in MODE_OBJECTS.values() if not mode.compiles_with_dynamo]
    return _node_row("sdopt Compile", runs, cannot, "; ".join(dict.fromkeys(fixes)),
                     "optim.compile.unavailable for every backend, and the inductor trial")


def _graph_row(ctx: Context) -> CheckRow:
    from ...optim.cuda_graph import GraphConfig, unavailable

    problem = unavailable(GraphConfig(), ctx.device)
    reason = (problem.reason if problem else None) or _trial_failed(ctx, "CUDA graph")
    return _node_row("sdopt CUDA Graph", [] if reason else ["capture and replay per input signature"], {"CUDA graphs": reason} if reason else {},
                     "needs an NVIDIA GPU; with on_unavailable=fallback the node passes the model through",
                     "optim.cuda_graph.unavailable and the capture trial")


def _offload_row(ctx: Context) -> CheckRow:
    from ...optim.offload import MODES, OffloadConfig, unavailable

    problem = unavailable(OffloadConfig(), ctx.device)
    reason = problem.reason if problem else None
    return _node_row("sdopt Offload", [] if reason else list(MODES), {"every mode": reason} if reason else {},
                     "needs a GPU: on a CPU the weights are already in RAM; with on_unavailable=fallback the node passes the model through",
                     "optim.offload.unavailable for this device")


# --- the torch-only nodes -------------------------------------------------------------------------


def _memory(ctx: Context) -> str:
    return "VRAM" if ctx.device.type == "cuda" else "RAM"


def _tiled_vae_row(ctx: Context) -> CheckRow:
    from ...optim.device import free_memory

    budget = free_memory(ctx.device)
    return _node_row("sdopt Tiled VAE", [f"tiled decode/encode, auto tile from {gib(budget)} free {_memory(ctx)}"], {}, "",
                     "optim.device.free_memory on this device")


def _low_memory_row(ctx: Context) -> CheckRow:
    return _node_row("sdopt Low Memory", ["sequential cfg, chunked GroupNorm/conv/feed-forward (those the model has), low_memory attention"], {}, "",
                     "nothing to check: torch only")


def _step_cache_row(ctx: Context) -> CheckRow:
    return _node_row("sdopt Step Cache", ["deepcache on UNets (SD1.5, SDXL), alone or under Compile and CUDA Graph",
                                          "first_block on diffusion transformers (SD3.5, Flux), beside regional Compile"], {}, "",
                     "nothing to check: torch only; the model decides (deepcache: a UNet with down, middle and up blocks; "
                     "first_block: a chain of transformer blocks)")


def _auto_row(ctx: Context) -> CheckRow:
    from ...optim.compile import CompileConfig
    from ...optim.compile import unavailable as compile_unavailable
    from ...optim.cuda_graph import GraphConfig
    from ...optim.cuda_graph import unavailable as graph_unavailable
    from ..stack_choice import DeviceFacts, fast_stack

    compile_problem, graph_problem = compile_unavailable(CompileConfig(), ctx.device), graph_unavailable(GraphConfig(), ctx.device)
    facts = DeviceFacts(ctx.device.type == "cuda", compile_problem.reason if compile_problem else None,
                        graph_problem.reason if graph_problem else None, True, "deepcache", 0, 0)
    return _node_row("sdopt Auto", [f"fastest exact stack for a UNet here: {fast_stack(facts, False).describe()}",
                                    "Low Memory, then Offload, where the predicted step or weights do not fit"], {}, "",
                     "the Compile and CUDA Graph checks for this device, as Auto makes them")


def _profiler_row(ctx: Context) -> CheckRow:
    return _node_row("sdopt Profiler", [f"step times, steady it/s, peak {_memory(ctx)}"], {}, "", "nothing to check: torch only")


def _report_row(ctx: Context) -> CheckRow:
    chart = importlib.util.find_spec("matplotlib") is not None
    return _node_row("sdopt Profile Report", ["table and JSON"] + (["chart"] if chart else []), {} if chart else {"chart": "matplotlib is not installed"},
                     "pip install matplotlib", "looked for matplotlib")


# --- every registered node's row ------------------------------------------------------------------

# The rows by the class names nodes/registry.py registers, in the table's order, in groups: each group is
# one check, so that a fault in one costs that group's rows, not every node's.
NODE_GROUPS: tuple[tuple[str, dict[str, RowBuilder]], ...] = (
    ("node: sdopt Precision and VAE Precision", {"SDOptPrecision": _precision_row, "SDOptVAEPrecision": _vae_precision_row}),
    ("node: sdopt Attention and VAE Attention", {"SDOptAttention": _attention_row, "SDOptVAEAttention": _vae_attention_row}),
    ("node: sdopt Compile", {"SDOptCompile": _compile_row}),
    ("node: sdopt CUDA Graph and Offload", {"SDOptCUDAGraph": _graph_row, "SDOptOffload": _offload_row}),
    ("node: sdopt Auto", {"SDOptAuto": _auto_row}),
    ("node: the torch-only nodes", {"SDOptTiledVAE": _tiled_vae_row, "SDOptLowMemory": _low_memory_row, "SDOptStepCache": _step_cache_row,
                                    "SDOptProfiler": _profiler_row, "SDOptProfileReport": _report_row}),
)
# Registered nodes without a row, and why.
WITHOUT_ROW = {"SDOptDoctor": "the doctor's table is what it shows"}
NODE_ROWS: dict[str, RowBuilder] = {node: build for _, group in NODE_GROUPS for node, build in group.items()}


def _group_check(group: dict[str, RowBuilder]) -> Callable[[Context], list[CheckRow]]:
    return lambda ctx: [build(ctx) for build in group.values()]


NODE_CHECKS: tuple[tuple[str, Callable[[Context], list[CheckRow]]], ...] = tuple((name, _group_check(group)) for name, group in NODE_GROUPS)


def check_nodes(ctx: Context) -> list[CheckRow]:
    return [row for _, check in NODE_CHECKS for row in check(ctx)]


def require_rows(registered: Iterable[str]) -> None:
    """Raise ``LookupError`` naming every node in ``registered`` (nodes/registry.py's class names) that has
    no row here, and every row of a node that is not registered."""
    registered = list(registered)
    missing = [node for node in registered if node not in NODE_ROWS and node not in WITHOUT_ROW]
    stale = [node for node in [*NODE_ROWS, *WITHOUT_ROW] if node not in registered]
    problems = ([f"{', '.join(missing)} registered in nodes/registry.py without a doctor row: give each a row builder in "
                 "NODE_GROUPS (nodes/checks/per_node.py), or a reason in WITHOUT_ROW"] if missing else [])
    problems += [f"{', '.join(stale)} not registered in nodes/registry.py, yet in NODE_GROUPS or WITHOUT_ROW: remove it"] if stale else []
    if problems:
        raise LookupError("; ".join(problems))
