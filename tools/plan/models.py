"""The models a plan builds: a generated model's name or the architecture a checkpoint file holds, and
its text encoders, diffusion model and VAE as diffusers and transformers modules."""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import UserError
from ...families import MODEL_NAMES, MMDiTConfig, checkpoint_config
from ..modelgen import (
    UNET_PREFIX,
    checkpoint_specs,
    diffusers_diffusion_model,
    diffusers_vae_config,
    transformers_clip_text_config,
)
from .settings import PARTS

MODELS = MODEL_NAMES


def architecture(model: str) -> str:
    """The name of a model sdopt generates (``mini``, ``sdxl-mini``, ``flux-mini``, ...): ``model``
    itself, or the one whose diffusion model (UNet or transformer) has the keys and shapes a
    checkpoint file holds under ``model.diffusion_model.``."""
    if model in MODELS:
        return model
    path = Path(model)
    if not path.is_file():
        raise UserError(f"--model {model!r}: not one of {', '.join(MODELS)} and no such file")
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own types for every kind of bad file
        raise UserError(f"--model {model!r}: not a readable .safetensors checkpoint ({error})") from None
    name = architecture_of_shapes(shapes)
    if name is None:
        raise UserError(f"--model {model!r}: its diffusion model matches none of the architectures the planner knows "
                        f"({', '.join(MODELS)}); plan one of those by name")
    return name


def architecture_of_shapes(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The generated model whose diffusion model has exactly these ``model.diffusion_model.`` keys
    and shapes (a checkpoint's other keys are ignored); None if none has."""
    diffusion = {k: tuple(shape) for k, shape in shapes.items() if k.startswith(UNET_PREFIX)}
    for name in MODELS:
        # Every key, not a subset: Flux.1-dev's is schnell's plus the guidance embedder.
        expected = {k: tuple(spec.shape) for k, spec in checkpoint_specs(name).items() if k.startswith(UNET_PREFIX)}
        if diffusion == expected:
            return name
    return None


def _diffusers():
    try:
        import diffusers
        import transformers
    except ImportError:
        raise UserError("plan builds the models with diffusers and transformers: pip install diffusers transformers") from None
    return diffusers, transformers


def text_encoders(model: str):
    """The text encoders ``model`` runs: its checkpoint's, then those of its own file (Flux's CLIP-L).
    No T5: sdopt generates none, and ComfyUI runs SD3.5 without it."""
    cfg = checkpoint_config(model)
    return cfg.text_encoders + cfg.separate_text_encoders


def text_encoder_names(model: str) -> tuple[str, ...]:
    """The modules of ``model``'s text encoders, as diffusers names them: ``text_encoder``, ``text_encoder_2``, ..."""
    count = len(text_encoders(model))
    return tuple("text_encoder" if index == 0 else f"text_encoder_{index + 1}" for index in range(count))


def build_modules(model: str, device: str | torch.device = "meta", names: tuple[str, ...] = PARTS) -> dict[str, torch.nn.Module]:
    """The parts of ``model`` named in ``names`` (``text_encoder``: every text encoder of its family,
    under ``text_encoder_names``; ``unet``: its diffusion model, a UNet or a diffusion transformer),
    on ``device``: on meta, the architecture only; elsewhere with diffusers'/transformers' random
    initialization."""
    diffusers, transformers = _diffusers()

    def text_encoder(index: int):
        text = text_encoders(model)[index]
        config = transformers.CLIPTextConfig(**transformers_clip_text_config(model, index))
        # An encoder with a text projection (SDXL's CLIP-G) also gives the pooled text.
        return (transformers.CLIPTextModelWithProjection if text.projection_dim else transformers.CLIPTextModel)(config)

    def diffusion_model():
        class_name, config = diffusers_diffusion_model(model)
        return getattr(diffusers, class_name)(**config)

    builders = {
        "unet": diffusion_model,
        "vae": lambda: diffusers.AutoencoderKL(**diffusers_vae_config(model)),
    }
    for index, name in enumerate(text_encoder_names(model)):
        builders[name] = lambda index=index: text_encoder(index)
    wanted = [n for part in names for n in (text_encoder_names(model) if part == "text_encoder" else (part,))]
    with torch.device(device):
        return {name: builders[name]().eval() for name in wanted}


def text_encoder_modules(modules: dict) -> list[torch.nn.Module]:
    return [module for name, module in sorted(modules.items()) if name.startswith("text_encoder")]


def largest_side(model: str) -> int | None:
    """The largest image side ``model`` takes: an MMDiT's stored position grid
    (``pos_embed_max_size`` patches a side) bounds its latent; None where nothing does."""
    cfg = checkpoint_config(model)
    diffusion = cfg.diffusion_model
    if isinstance(diffusion, MMDiTConfig):
        return diffusion.pos_embed_max_size * diffusion.patch_size * cfg.vae.downscale
    return None
