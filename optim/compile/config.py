"""Compile settings: ``CompileConfig`` (mode, backend, torch.compile's options) and why a setting
cannot run on a device here (``unavailable``), with the fix. What differs by mode is asked of the
mode's object (``CompileConfig.kind``, from ``modes``)."""
from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import Unavailable
from .modes import MODE_OBJECTS, CompileMode

BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")



@dataclass(frozen=True)
class CompileConfig:
    mode: str = "compile"
    backend: str = "inductor"
    compile_mode: str = "default"
    dynamic: bool = False
    fullgraph: bool = False
    freeze: bool = False
    max_traces: int = 4
    block_classes: tuple[str, ...] = ()  # compile_regional's blocks, by class name (the model family's repeated blocks)
    # compile_regional: what each dict a block is handed (its options) becomes before the compiled block sees
    # it; a host leaves out what differs from block to block and the blocks do not use, since dynamo guards
    # on what it reads, and alike blocks then share one compiled entry
    block_options: Callable[[dict], dict] | None = None

    def __post_init__(self):
        for name, value, allowed in (("mode", self.mode, MODE_OBJECTS), ("backend", self.backend, BACKENDS), ("compile_mode", self.compile_mode, COMPILE_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")

    @property
    def kind(self) -> CompileMode:
        """The object of ``mode``."""
        return MODE_OBJECTS[self.mode]

    def torch_compile_kwargs(self) -> dict:
        return {
            "backend": self.backend,
            "mode": None if self.compile_mode == "default" or self.backend != "inductor" else self.compile_mode,
            "dynamic": True if self.dynamic else self.kind.dynamic_unasked,
            "fullgraph": self.fullgraph,
        }

    def settings(self) -> str:
        return self.kind.settings(self)

    def backend_unavailable(self, device: torch.device) -> Unavailable | None:
        """Why torch.compile's ``backend`` cannot compile on ``device`` here and the fix that fits, or
        None when it can (asked by the modes that compile with it)."""
        other_backend = "pick backend aot_eager or eager, or mode trace"
        if self.backend == "inductor":
            if device.type == "cuda" and importlib.util.find_spec("triton") is None:
                return Unavailable("inductor on CUDA needs Triton (pip install triton)", f"install triton, or {other_backend}", "backend")
            if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
                return Unavailable("inductor on a CPU needs a C++ compiler (g++ or clang++)", f"install g++ or clang++, or {other_backend}", "backend")
        if self.backend == "cudagraphs" and device.type != "cuda":
            return Unavailable(f"the cudagraphs backend needs a CUDA device; this model runs on {device.type}",
                               "pick backend inductor, aot_eager or eager, or mode trace", "backend")
        return None


def unavailable(config: CompileConfig, device: torch.device) -> Unavailable | None:
    """Why ``config`` cannot run on ``device`` here and the fix that fits, or None when it can."""
    return config.kind.unavailable(config, device)


def nchw_conv_weight_bytes(module: torch.nn.Module, config: CompileConfig) -> int:
    """Bytes of 2-D conv weights that inductor copies to channels-last on every call: it lays such
    convolutions out channels-last (its layout optimization) and the weights are graph inputs, so
    weights stored NCHW are converted each time. Stored channels-last, they are used as they are."""
    if not config.kind.uses_inductor(config):
        return 0
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    return sum(w.numel() * w.element_size() for w in weights if not w.is_contiguous(memory_format=torch.channels_last))
