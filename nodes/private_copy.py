"""Private copies of a diffusion model or VAE: ``private_copy`` gives a diffusion model its own converted
weights and a patcher that carries the input's patches, options, wrappers and callbacks; the weights are
converted from those the model had before any sdopt copy, so chained copies round once. The input model and
every clone of it are left as they are, and none of ComfyUI 0.38's dynamic VRAM state comes along."""
from __future__ import annotations

import inspect
import uuid
import weakref
from collections.abc import Callable

import torch

from ..errors import UserError
from .environment import is_dynamic, static_attribute
from .patching import copy_vae

def is_quantized(model) -> bool:
    """Whether the diffusion model holds quantized weights (scaled fp8, int8, nvfp4...)."""
    config = model.model.model_config
    quantized = static_attribute(config, "quant_config") is not None or static_attribute(config, "scaled_fp8") is not None
    return quantized or any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.model.diffusion_model.parameters())


def refuse_quantized(model, input_name: str, fix: str) -> None:
    """A ``UserError`` under ``input_name`` when the model holds quantized weights, whose scales a
    converted copy would drop."""
    if is_quantized(model):
        raise UserError(
            f"{input_name}: this model holds quantized weights (scaled fp8, int8, nvfp4...), and a converted copy "
            f"would drop their scales; {fix} (ComfyUI runs quantized checkpoints natively)"
        )


# What ComfyUI 0.38's dynamic VRAM (comfy-aimdo) keeps on a model it manages, from the moment its
# patcher is made: address-space reservations, pinned host buffers and its patchers, on the model; and
# once loaded, on each layer: a staging slot, whose presence alone routes the layer's forward through
# aimdo, the slot's signature, the pinned buffers, the on-the-fly weight patch, and cast weights turned
# on, which no unload turns off; and after the layer's first forward, views over its VRAM window
# (weight, bias, the prefetch plan) and over pinned host memory, which no unload deletes either. A
# private copy takes none of it (the class defaults show again, as in a fresh load): sharing would let
# the copy touch the original's VRAM and pins, and a deep copy would read a window the unload just
# freed, duplicate pinned buffers or fail on native handles.
DYNAMIC_VRAM_MODEL_STATE = ("dynamic_vbars", "dynamic_pins", "dynamic_patchers")


DYNAMIC_VRAM_LAYER_STATE = DYNAMIC_VRAM_MODEL_STATE + (
    "_v", "_v_block", "_v_signature", "_pin_state", "weight_lowvram_function", "bias_lowvram_function", "comfy_cast_weights",
    "_v_weight", "_v_bias", "_v_block_faulted", "_prefetch", "_pins")


def _unload_everywhere(module: torch.nn.Module, given=None) -> None:
    """Unload every patcher that has ``module`` loaded, so its weights are the unpatched originals.

    ComfyUI 0.38's dynamic VRAM applies weight patches as each layer streams, so a module it manages
    holds its original weights while its unload leaves ``current_weight_patches_uuid`` set. Whether it
    manages ``module`` is read from the patchers, ``given`` (the node's input) and those loaded, and
    from the state it keeps on the module; ``module.current_patcher`` is set only while a sampler runs."""
    import comfy.model_management as mm

    patchers = [given] if given is not None and given.model is module else []
    for loaded in list(mm.current_loaded_models):
        if loaded.model is not None and loaded.model.model is module:
            patchers.append(loaded.model)
            loaded.model_unload()
            mm.current_loaded_models.remove(loaded)
    dynamic = any(is_dynamic(p) for p in patchers) or any(hasattr(module, name) for name in DYNAMIC_VRAM_MODEL_STATE)
    if getattr(module, "current_weight_patches_uuid", None) is not None and not dynamic:
        raise RuntimeError("the model still has patched weights after unloading; cannot copy its original weights")


def _shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module sharing ``module``'s attributes but with its own parameter, buffer and child
    tables, so replacing a child on the copy leaves the original as it is."""
    duplicate = module.__class__.__new__(module.__class__)
    duplicate.__dict__.update(module.__dict__)
    for table in ("_parameters", "_buffers", "_modules"):
        duplicate.__dict__[table] = module.__dict__[table].copy()
    return duplicate


def rebased(patcher, module: torch.nn.Module):
    """A patcher of ``module`` with ``patcher``'s recipe: patches, options, wrappers, callbacks.

    Where ``clone`` takes a ``model_override`` (ComfyUI 0.33 and newer), ComfyUI builds it, as for
    its multi-GPU copies, non-dynamic, with fresh backups and no factory that reloads the original.
    Older ComfyUI: a new patcher gets every field of a clone that is not tied to the model.
    """
    parameters = inspect.signature(patcher.clone).parameters
    if "model_override" in parameters:
        backups = tuple(type(b)() for b in patcher.get_clone_model_override()[1])
        options = {"disable_dynamic": True} if "disable_dynamic" in parameters else {}
        clone = patcher.clone(model_override=(module, backups), **options)
        clone.cached_patcher_init = None
        clone.size = 0  # clone() passed the original's size; model_size() measures the copy instead
        # clone() shares these with the input, tied to the input's weights: hook LoRAs' weight backups and
        # cached patched weights, and the identity multi-GPU copies compare
        for name, fresh in (("hook_backup", dict), ("cached_hook_patches", dict), ("clone_base_uuid", uuid.uuid4)):
            if hasattr(clone, name):
                setattr(clone, name, fresh())
        return clone
    clone = patcher.clone()
    fresh = type(patcher)(module, patcher.load_device, patcher.offload_device, weight_inplace_update=patcher.weight_inplace_update)
    tied = {"model", "size", "backup", "object_patches_backup", "hook_backup", "hook_patches_backup", "cached_hook_patches",
            "patches_uuid", "parent", "is_injected", "pinned", "backup_buffers", "cached_patcher_init", "clone_base_uuid",
            "non_dynamic_delegate_model", "_last_prepare_log_key"}
    for name, value in vars(clone).items():
        if name not in tied and name in vars(fresh):
            setattr(fresh, name, value)
    return fresh


# A private copy's module → a weak reference to the module it was converted from, the weights as they
# were before any sdopt copy: a chained copy converts from those, so two nodes in a row round once,
# as the second alone would. Weak, so that a copy never keeps alive a model ComfyUI let go.
_copied_from: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


SOURCE_FREED = "converted from the earlier sdopt copy's weights: the model it was copied from is no longer loaded"


def copy_source(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module whose weights a private copy of ``module`` converts, a note): the module before
    any sdopt copy; ``module`` itself where it is no sdopt copy, or where its source was freed (noted)."""
    ref = _copied_from.get(module)
    source = ref() if ref is not None else None
    if source is None:
        return module, SOURCE_FREED if ref is not None else ""
    return source, ""


def loaded_weight_dtype(model) -> torch.dtype:
    """The diffusion model's weight dtype as ComfyUI loaded it: before any sdopt copy."""
    return copy_source(model.model)[0].get_dtype()


def _mark_copy(copied: torch.nn.Module, source: torch.nn.Module) -> None:
    _copied_from[copied] = weakref.ref(source)


def private_copy(model, convert: Callable[[torch.nn.Module], torch.nn.Module], notes: list[str] | None = None):
    """A patcher with the recipe of ``model`` over a BaseModel whose diffusion model is
    ``convert(original diffusion model)``, the original being the one before any sdopt copy;
    ``model`` and every clone of it are left as they are. ``notes`` gets a line where that
    original is gone and the input's weights were converted instead."""
    import comfy.model_management as mm

    base = model.model
    source, note = copy_source(base)
    _unload_everywhere(source, model)
    copied = _shallow_module_copy(base)
    for name in DYNAMIC_VRAM_MODEL_STATE:
        copied.__dict__.pop(name, None)
    copied.diffusion_model = convert(source.diffusion_model)
    copied.current_patcher = copied.current_weight_patches_uuid = None  # a dynamic unload leaves the uuid set
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(copied.diffusion_model)
    _mark_copy(copied, source)
    if note and notes is not None:
        notes.append(note)
    return rebased(model, copied)


def private_vae_copy(vae, convert: Callable[[torch.nn.Module], torch.nn.Module], notes: list[str] | None = None):
    """A copy of ``vae`` with its own ``convert``-ed weights, converted from the VAE's weights before
    any sdopt copy, and its own patcher; ``notes`` as for ``private_copy``."""
    import comfy.model_management as mm

    source, note = copy_source(vae.first_stage_model)
    _unload_everywhere(source, vae.patcher)
    duplicate = copy_vae(vae)
    duplicate.first_stage_model = convert(source)
    duplicate.first_stage_model.current_weight_patches_uuid = None  # as private_copy's: a fresh VAE's state
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(duplicate.first_stage_model)
    duplicate.patcher = rebased(vae.patcher, duplicate.first_stage_model)
    _mark_copy(duplicate.first_stage_model, source)
    if note and notes is not None:
        notes.append(note)
    return duplicate
