"""The model families sdopt knows, and the model names (``mini``, ``sdxl-mini``) that pick one of
their generated checkpoints. A new family is one module here that builds a ``Family``, added to
``FAMILIES``."""
from __future__ import annotations

from ..errors import UserError
from .family import (
    UNET_PREFIX,
    VAE_PREFIX,
    CheckpointConfig,
    DiffusionCall,
    DiffusionModelConfig,
    Family,
    FluxConfig,
    LatentFormat,
    MMDiTConfig,
    TextEncoderConfig,
    UNetConfig,
    VAEConfig,
)
from .flux import FLUX
from .sd15 import SD15
from .sd35 import SD35
from .sdxl import SDXL

FAMILIES: dict[str, Family] = {family.name: family for family in (SD15, SDXL, SD35, FLUX)}
MODEL_NAMES: tuple[str, ...] = tuple(name for family in FAMILIES.values() for name in family.model_names)


def resolve_model(name: str) -> tuple[Family, str]:
    """(family, size) of a generated model's name: ``mini`` → (SD1.5, mini), ``sdxl-mini`` → (SDXL, mini)."""
    for family in FAMILIES.values():
        for size in family.sizes:
            if family.model_name(size) == name:
                return family, size
    raise UserError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")


def checkpoint_config(name: str) -> CheckpointConfig:
    family, size = resolve_model(name)
    return family.sizes[size]


def model_name_of_file(filename: str) -> str | None:
    """The model name whose generated checkpoint is called ``filename`` (``sdopt-mini-sdxl.safetensors``
    → ``sdxl-mini``), None for any other file name."""
    for family in FAMILIES.values():
        for size in family.sizes:
            if family.checkpoint_filename(size) == filename:
                return family.model_name(size)
    return None


def family_of_config_class(cls: type) -> Family | None:
    """The family of a ComfyUI ``supported_models`` class (or a subclass of one), None if sdopt has none."""
    names = {base.__name__ for base in cls.__mro__}
    for family in FAMILIES.values():
        if names.intersection(family.comfy_configs):
            return family
    return None


__all__ = [
    "FAMILIES", "MODEL_NAMES", "UNET_PREFIX", "VAE_PREFIX", "CheckpointConfig", "DiffusionCall",
    "DiffusionModelConfig", "Family", "FluxConfig", "LatentFormat", "MMDiTConfig", "TextEncoderConfig", "UNetConfig", "VAEConfig", "checkpoint_config", "family_of_config_class",
    "model_name_of_file", "resolve_model",
]
