"""ComfyUI's memory mode in a headless process: dynamic VRAM (comfy-aimdo) where ComfyUI's own server
would start it, so that ``sdopt run`` and the benches measure what a browser user of the same ComfyUI
on the same machine gets.

ComfyUI starts dynamic VRAM in ``main.py``, in module code nothing can import, in two steps that this
module repeats, feature-detected: comfy-aimdo's library is loaded before ``comfy.model_management`` is
imported (comfy-aimdo's own modules read its handle when they are imported), and once ComfyUI knows its
devices, aimdo takes them, ``ModelPatcherDynamic`` becomes the core patcher and
``comfy.memory_management.aimdo_enabled`` is set. ``auto`` decides as ``main.py`` does by default;
``classic`` is ``--disable-dynamic-vram``; ``dynamic`` is ``--enable-dynamic-vram``, refused with the
reason and a fix where it cannot start.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

from ..errors import UserError
from ..measure.report import CLASSIC_MEMORY, DYNAMIC_VRAM
from ..nodes.environment import NO_AIMDO, NO_CUDA, NOT_OFFERED, kept_off_by_device, kept_off_by_settings

AUTO, DYNAMIC, CLASSIC = "auto", "dynamic", "classic"
MODES = (AUTO, DYNAMIC, CLASSIC)
ENVIRONMENT = "SDOPT_MEMORY_MODE"  # how the CLI's --memory-mode reaches the processes a bench starts
_OPTION = f"--memory-mode (or ${ENVIRONMENT})"
_AIMDO_FIX = "install comfy-aimdo at the version in ComfyUI's requirements.txt"
_CLASSIC_FIX = "leave --memory-mode at auto (or classic) to run with classic memory management"


def requested_mode(explicit: str | None = None) -> str:
    """The mode asked for: ``explicit``, else ``$SDOPT_MEMORY_MODE``, else auto."""
    mode = explicit or os.environ.get(ENVIRONMENT) or AUTO
    if mode not in MODES:
        raise UserError(f"{_OPTION}: {mode!r} is not a memory mode; give one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class MemoryMode:
    """What the process runs with. ``dynamic``: None where this ComfyUI has no dynamic VRAM; ``why``: one
    line on how that came about."""

    requested: str
    dynamic: bool | None
    why: str

    @property
    def label(self) -> str | None:
        """As a report names it (``Report.memory_mode``)."""
        return None if self.dynamic is None else DYNAMIC_VRAM if self.dynamic else CLASSIC_MEMORY


class MemoryModeStart:
    """Both steps of ComfyUI's start-up for one process: ``load_library`` before ComfyUI's model
    management is imported, ``take_devices`` after."""

    def __init__(self, requested: str, cuda: bool):
        self.requested, self.cuda = requested, cuda
        self.control = None
        self.outcome: MemoryMode | None = None

    def _refuse(self, reason: str, fix: str) -> None:
        raise UserError(f"{_OPTION} dynamic: {reason}; {fix}")

    def _classic(self, why: str) -> None:
        self.outcome = MemoryMode(self.requested, False, why)

    def load_library(self) -> None:
        """Step one: ``comfy.cli_args`` is imported with ComfyUI's argv already set."""
        cli_args = importlib.import_module("comfy.cli_args")
        enables = getattr(cli_args, "enables_dynamic_vram", None)
        if enables is None:
            if self.requested == DYNAMIC:
                self._refuse(NOT_OFFERED, "use a ComfyUI that offers it, or " + _CLASSIC_FIX)
            self.outcome = MemoryMode(self.requested, None, NOT_OFFERED)
            return
        args = cli_args.args
        if self.requested == CLASSIC:
            args.disable_dynamic_vram = True
            self._classic("classic memory management asked for (--memory-mode classic)")
            return
        if not self.cuda:
            if self.requested == DYNAMIC:
                self._refuse("there is no CUDA device, and dynamic VRAM manages GPU memory",
                             "run it on an NVIDIA GPU, or " + _CLASSIC_FIX)
            self._classic(NO_CUDA)
            return
        if self.requested == DYNAMIC:
            args.enable_dynamic_vram = True
        elif why := kept_off_by_settings(enables):
            self._classic(why)
            return
        try:
            control = importlib.import_module("comfy_aimdo.control")
        except ImportError:
            if self.requested == DYNAMIC:
                self._refuse(NO_AIMDO, _AIMDO_FIX)
            self._classic(NO_AIMDO)
            return
        headroom = None if getattr(args, "reserve_vram", None) is None else int(args.reserve_vram * 2**30)
        nvml = not getattr(args, "disable_nvml_pressure", False)
        try:
            loaded = control.init(simple_vram_headroom=headroom, nvml_pressure=nvml)
        except TypeError:  # comfy-aimdo 0.4.10 and older take fewer of these
            try:
                loaded = control.init(simple_vram_headroom=headroom)
            except TypeError:
                loaded = control.init()
        if loaded is False:
            if self.requested == DYNAMIC:
                self._refuse("comfy-aimdo could not load its library (ComfyUI's log says why)", _AIMDO_FIX + " for this GPU")
            self._classic("comfy-aimdo could not load its library")
            return
        self.control = control

    def take_devices(self) -> MemoryMode:
        """Step two: ComfyUI's model management, patchers and memory management are imported."""
        if self.outcome is not None:
            return self.outcome
        mm = importlib.import_module("comfy.model_management")
        if self.requested == AUTO and (why := kept_off_by_device(mm)):
            self._classic(why)
            return self.outcome
        args = importlib.import_module("comfy.cli_args").args
        extra = int(getattr(args, "vram_headroom", 0) * 2**30)
        devices = list(mm.get_all_torch_devices())
        try:
            taken = self.control.init_devices([(device.index, extra) for device in devices])
        except TypeError:  # comfy-aimdo 0.4.9 takes bare indices
            taken = self.control.init_devices([device.index for device in devices])
        if not taken:
            if self.requested == DYNAMIC:
                self._refuse("comfy-aimdo could not take this GPU (ComfyUI's log says why)", _AIMDO_FIX + " for this driver")
            self._classic("comfy-aimdo could not take this GPU")
            return self.outcome
        if level := getattr(self.control, "set_log_info", None):
            level()
        patchers = importlib.import_module("comfy.model_patcher")
        patchers.CoreModelPatcher = patchers.ModelPatcherDynamic
        importlib.import_module("comfy.memory_management").aimdo_enabled = True
        logging.info("DynamicVRAM support detected and enabled")
        self.outcome = MemoryMode(self.requested, True, "on, as a ComfyUI server on this GPU starts it"
                                  if self.requested == AUTO else "on (--memory-mode dynamic)")
        return self.outcome

