"""The diffusion model's state dict and diffusers class, picked by the type of its config: a new
architecture is a module beside ``unet``, ``mmdit`` and ``flux`` and an entry in each table here."""
from __future__ import annotations

from ...families import DiffusionModelConfig, FluxConfig, MMDiTConfig, UNetConfig, checkpoint_config
from .flux import flux_specs, flux_transformer_config
from .mmdit import mmdit_specs, sd3_transformer_config
from .specs import TensorSpec
from .unet import diffusers_unet_config, unet_ldm_specs

_DIFFUSION_MODEL_SPECS = {UNetConfig: unet_ldm_specs, MMDiTConfig: mmdit_specs, FluxConfig: flux_specs}


def diffusion_model_specs(cfg: DiffusionModelConfig) -> dict[str, TensorSpec]:
    """The state dict of a diffusion model in ComfyUI's format (keys without ``model.diffusion_model.``)."""
    return _DIFFUSION_MODEL_SPECS[type(cfg)](cfg)


_DIFFUSERS_DIFFUSION_MODELS = {
    UNetConfig: ("UNet2DConditionModel", lambda cfg, name: diffusers_unet_config(name)),
    MMDiTConfig: ("SD3Transformer2DModel", lambda cfg, name: sd3_transformer_config(cfg)),
    FluxConfig: ("FluxTransformer2DModel", lambda cfg, name: flux_transformer_config(cfg)),
}


def diffusers_diffusion_model(name: str) -> tuple[str, dict]:
    """(the diffusers class, its kwargs) matching the diffusion model of model ``name``:
    ``UNet2DConditionModel``, ``SD3Transformer2DModel`` (an MMDiT) or ``FluxTransformer2DModel``."""
    cfg = checkpoint_config(name)
    class_name, config = _DIFFUSERS_DIFFUSION_MODELS[type(cfg.diffusion_model)]
    return class_name, config(cfg, name)
