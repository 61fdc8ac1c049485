"""Every check of the doctor, in order (``CHECKS``), run on one device (``run_checks``): a check that raises
becomes one failed row, and the others still run."""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from .comfyui import check_comfyui, check_compile_cache
from .device import check_device, check_dtypes, check_torch, usable_device
from .kernels import check_attention, check_cuda_graph, check_inductor
from .per_node import NODE_CHECKS
from .rows import FAILED, CheckRow, ComfyInfo, Context, first_line

ISSUES = "https://github.com/sdopt/sdopt/issues"

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


def _raised_at(error: BaseException) -> str:
    """The innermost frame of ``error``'s traceback, as file:line in function."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "no traceback"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


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
            found = [CheckRow(name, f"the {name} check", FAILED, f"the check itself raised {first_line(error)} ({_raised_at(error)})",
                              f"report it at {ISSUES} with this table")]
        seconds = (time.perf_counter() - started) / len(found)
        for row in found:
            row.seconds = round(seconds, 3)
            ctx.rows[row.check] = row
        rows.extend(found)
    return rows
