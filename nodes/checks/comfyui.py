"""The doctor's look at ComfyUI and sdopt's compile cache: ComfyUI's version and the APIs sdopt's nodes use,
read from the ComfyUI modules already imported (the CLI imports them, ``tools.doctor.load_comfyui``; the
sdopt Doctor node reads the running server's), its memory mode and whether a server would start dynamic
VRAM here, its device; and the compile cache listed and written to.
"""
from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

import torch

from ..environment import server_would_start
from .rows import FAILED, MIB, OK, UNAVAILABLE, WARN, CheckRow, ComfyInfo, Context

# --- ComfyUI's version, APIs and device -----------------------------------------------------------

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


def read_version(path: Path) -> str | None:
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
    version = read_version(Path(path)) if path else None
    return ComfyInfo(str(path) if path else None, version, tuple(missing), None if dynamic is None else bool(dynamic), in_server)


def comfyui_device() -> torch.device | None:
    """The device ComfyUI's nodes run on, where its model management is imported."""
    model_management = sys.modules.get("comfy.model_management")
    return torch.device(model_management.get_torch_device()) if model_management is not None else None


def default_device(comfyui: ComfyInfo | None) -> torch.device:
    """ComfyUI's device where its model management was imported, else CUDA when present, else the CPU."""
    if comfyui is not None and not comfyui.error:
        device = comfyui_device()
        if device is not None:
            return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- the ComfyUI rows -----------------------------------------------------------------------------

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


# --- sdopt's compile cache ------------------------------------------------------------------------


def _write_probe(folder: Path) -> None:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".sdopt-doctor-"):
        pass


def check_compile_cache(ctx: Context) -> list[CheckRow]:
    from ...optim.compile import cache_entries, default_cache_dir, foreign_items, users_cache_dirs

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
