"""The ComfyUI sdopt runs in, as nodes ask about it: its version, its memory mode (0.38's dynamic VRAM or
classic, and whether a server would start dynamic VRAM here) and the dynamic-VRAM probe, a clone dynamic VRAM does not stream, the memory a node may use now, its
attention module, and the family of a patcher's model. Every difference between ComfyUI versions is
feature-detected, never read from a version string."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import Unavailable
from ..families import SD15, DiffusionCall, Family, family_of_config_class
from ..measure.report import CLASSIC_MEMORY, DYNAMIC_VRAM
from ..optim.device import free_memory

def comfy_attention():
    from comfy.ldm.modules import attention

    return attention


def static_attribute(obj, name: str):
    """An attribute without triggering ``__getattr__`` (0.33's model config logs and returns None)."""
    return inspect.getattr_static(obj, name, None)


def is_dynamic(patcher) -> bool:
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def free_for_work(device: torch.device, patcher=None) -> int:
    """Bytes a node may use on ``device`` now, as ComfyUI plans: what the device can still allocate,
    plus what ComfyUI 0.38's dynamic VRAM would hand back from streamed weights (``patcher``'s view of
    free memory counts it), less the VRAM ComfyUI keeps for other applications (``--reserve-vram``)."""
    from comfy import model_management

    free = free_memory(device)
    reserved = getattr(model_management, "extra_reserved_memory", None)
    if torch.device(device).type == "cpu" or not callable(reserved):
        return free
    if hasattr(patcher, "get_free_memory"):
        free += max(0, patcher.get_free_memory(torch.device(device)) - model_management.get_free_memory(torch.device(device)))
    return max(free - int(reserved()), 0)

# --- the model's family ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFamily:
    """The family of a patcher's model, found from ComfyUI's config class (``config_class``).

    ``family`` is None where sdopt does not know that class. ``described`` is then the LDM UNet
    that sdopt served before it knew families (SD1.5's call and blocks): that keeps working for
    every model ComfyUI calls the same way, and ``label`` and ``unknown_note`` say it was assumed.
    """

    family: Family | None
    config_class: str

    @property
    def described(self) -> Family:
        return self.family or SD15

    @property
    def call(self) -> DiffusionCall:
        return self.described.call

    @property
    def label(self) -> str:
        return self.family.title if self.family else f"family unknown ({self.config_class})"

    @property
    def unknown_note(self) -> str:
        """What a record says where the family is unknown; empty where it is known."""
        if self.family:
            return ""
        return f"{self.label}: its diffusion model is called as {SD15.title}'s UNet is ({', '.join(SD15.call.tensor_inputs)})"


def model_family(model) -> ModelFamily:
    """The family of the model ``model`` (a ModelPatcher) holds."""
    config = static_attribute(model.model, "model_config")
    config_class = type(config) if config is not None else type(model.model)
    return ModelFamily(family_of_config_class(config_class), config_class.__name__)


def inference_dtypes(model) -> tuple[torch.dtype, ...] | None:
    """The dtypes ComfyUI runs this model in, its preferred first (``supported_inference_dtypes``);
    None where its config does not say."""
    config = static_attribute(model.model, "model_config")
    dtypes = getattr(config, "supported_inference_dtypes", None)
    return tuple(dtypes) if dtypes else None

# --- what this ComfyUI offers: its version, dynamic VRAM ---------------------------------------------

def comfyui_version() -> str | None:
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return __version__


def aimdo_installed() -> bool:
    """Whether comfy-aimdo (dynamic VRAM's allocator) can be imported here: imported already, blocked
    (None in ``sys.modules``), or findable."""
    if "comfy_aimdo" in sys.modules:
        return sys.modules["comfy_aimdo"] is not None
    return importlib.util.find_spec("comfy_aimdo") is not None


def memory_mode(device) -> tuple[str | None, str]:
    """(mode, note): whether ComfyUI manages memory with 0.38's dynamic VRAM or classically in this
    process, None where this ComfyUI has no dynamic VRAM; the note says where ComfyUI would start it on
    this GPU by default and was told not to (``--disable-dynamic-vram``, sdopt's ``--memory-mode classic``)."""
    memory_management = sys.modules.get("comfy.memory_management")
    if not hasattr(memory_management, "aimdo_enabled"):
        return None, ""
    if memory_management.aimdo_enabled:
        return DYNAMIC_VRAM, ""
    cli_args = sys.modules.get("comfy.cli_args")
    turned_off = getattr(getattr(cli_args, "args", None), "disable_dynamic_vram", False)
    if torch.device(device).type == "cuda" and turned_off and aimdo_installed():
        return CLASSIC_MEMORY, ("dynamic VRAM turned off (--disable-dynamic-vram or --memory-mode classic), where ComfyUI "
                                "turns it on by default on this GPU: these figures are classic memory management's")
    return CLASSIC_MEMORY, ""


def dynamic_vram_probe(device) -> Callable[[], int] | None:
    """Where ComfyUI 0.38's dynamic VRAM is on: the bytes on ``device`` mapped past PyTorch's allocator
    (streamed weights, malloc graphs); else None. comfy-aimdo hooks every device allocation in the
    process, on every GPU, so its total counts PyTorch's own segments on each too, which the probe takes
    off; what it maps on another GPU counts as this one's (ComfyUI runs a model on one)."""
    memory_management = sys.modules.get("comfy.memory_management")
    if not getattr(memory_management, "aimdo_enabled", False):
        return None
    try:
        from comfy_aimdo import control
    except ImportError:
        return None
    usage = getattr(control, "get_total_vram_usage", None)
    if usage is None or torch.device(device).type != "cuda":
        return usage
    return lambda: max(0, usage() - sum(torch.cuda.memory_reserved(index) for index in range(torch.cuda.device_count())))


DELEGATE_NOTE = "dynamic VRAM patcher: running on its non-dynamic delegate, which ComfyUI loads again from the checkpoint file"


def non_dynamic_clone(model) -> tuple[object, str, Unavailable | None]:
    """(clone, note, problem): a clone that ComfyUI 0.38's dynamic VRAM does not stream (graphs,
    compiled code and a per-model VRAM budget need fixed weight addresses), as ComfyUI's own
    TorchCompileModel makes it. Where ComfyUI cannot make one (the model came from a loader that
    leaves no way to load it again), a plain clone and the problem, for the node's ``on_unavailable``."""
    if not (is_dynamic(model) and hasattr(model, "get_non_dynamic_delegate")):
        return model.clone(), "", None
    try:
        return model.get_non_dynamic_delegate(), DELEGATE_NOTE, None
    except RuntimeError as failure:
        return model.clone(), "", Unavailable(
            f"ComfyUI's dynamic VRAM streams this model and cannot load a copy of it without ({str(failure).splitlines()[0]})",
            "load it with a checkpoint or diffusion-model loader, or start ComfyUI with dynamic VRAM off", "model")


# --- whether a ComfyUI server would start dynamic VRAM here (tools.memory_mode decides the same way) ---

NOT_OFFERED = "this ComfyUI has no dynamic VRAM"
NO_CUDA = "no CUDA device, where ComfyUI keeps dynamic VRAM off"
NO_AIMDO = "comfy-aimdo is not installed"


def kept_off_by_settings(enables) -> str | None:
    return None if enables() else "off by ComfyUI's settings (--highvram, --gpu-only or --novram)"


def kept_off_by_device(mm) -> str | None:
    """Why ComfyUI's main.py would not start dynamic VRAM on this GPU by default (``mm``:
    comfy.model_management); None where it would."""
    amd_ready = bool(getattr(mm, "is_amd", lambda: False)()) and getattr(mm, "rocm_version", (0, 0)) >= (7, 14)
    if not (mm.is_nvidia() or amd_ready):
        return "this GPU is not one that ComfyUI manages with dynamic VRAM"
    if getattr(mm, "torch_version_numeric", (2, 8)) < (2, 8):
        return "PyTorch older than 2.8, where ComfyUI keeps dynamic VRAM off"
    return None


def server_would_start(cuda: bool) -> tuple[bool | None, str]:
    """With ComfyUI's ``cli_args`` and ``model_management`` imported but nothing started (``sdopt
    doctor``): whether its server would start dynamic VRAM on this machine by default, and why not.
    None where this ComfyUI has none; True where it would try (comfy-aimdo may still refuse the GPU)."""
    enables = getattr(sys.modules.get("comfy.cli_args"), "enables_dynamic_vram", None)
    if enables is None:
        return None, NOT_OFFERED
    why = (NO_CUDA if not cuda else kept_off_by_settings(enables)
           or (None if aimdo_installed() else NO_AIMDO)
           or kept_off_by_device(sys.modules["comfy.model_management"]))
    return why is None, why or ""
