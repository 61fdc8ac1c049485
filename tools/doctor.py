"""``python -m sdopt doctor``'s own step before the checks (``nodes/checks``): ComfyUI imported from a path,
without booting it (``load_comfyui``), so that the checks can read what its modules offer."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from ..errors import UserError
from ..nodes.checks import ComfyInfo, comfyui_info, first_line, read_version


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
        return ComfyInfo(str(root), read_version(root), error=first_line(error))
    finally:
        sys.argv = argv
    return comfyui_info(root, in_server=False)
