"""The single-file checkpoint of a model name: every tensor it holds (diffusion model, text encoders,
VAE; a family's separate text encoder file), written deterministically, or only where missing."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import UserError
from ...families import MODEL_NAMES, UNET_PREFIX, checkpoint_config, resolve_model
from .architectures import diffusion_model_specs
from .block_mean_vae import block_mean_vae_tensors
from .files import CheckpointSummary, checked_out_path, write_safetensors
from .specs import TensorSpec, param_count
from .text_encoders import text_encoder_specs
from .trained import load_trained
from .vae import vae_ldm_specs

# The model names the generator knows (bench_* import this name).
SIZES = MODEL_NAMES


def checkpoint_specs(name: str) -> dict[str, TensorSpec]:
    """Every tensor of the single-file checkpoint of model ``name``, with full keys."""
    cfg = checkpoint_config(name)
    parts = [(UNET_PREFIX, diffusion_model_specs(cfg.diffusion_model))]
    parts += [(text.prefix, text_encoder_specs(text)) for text in cfg.text_encoders]
    parts.append((cfg.vae_prefix, vae_ldm_specs(cfg.vae)))
    return {prefix + key: spec for prefix, part in parts for key, spec in part.items()}


def given_tensors(name: str) -> dict[str, torch.Tensor]:
    """The tensors of model ``name``'s checkpoint that are not random (full keys): a reference model's
    shipped diffusion model and its block-mean VAE; empty for the generated models."""
    family, _ = resolve_model(name)
    cfg = checkpoint_config(name)
    given: dict[str, torch.Tensor] = {}
    if cfg.trained:
        given.update({UNET_PREFIX + key: tensor for key, tensor in load_trained(name).items()})
    if cfg.vae.block_mean:
        given.update({cfg.vae_prefix + key: tensor for key, tensor in block_mean_vae_tensors(cfg.vae, family.latent).items()})
    return given


def separate_text_encoder_specs(name: str) -> dict[str, TensorSpec]:
    """Every tensor of model ``name``'s text encoder file (empty where its checkpoint carries them)."""
    cfg = checkpoint_config(name)
    return {text.prefix + key: spec for text in cfg.separate_text_encoders for key, spec in text_encoder_specs(text).items()}


def text_encoder_path(checkpoint: str | os.PathLike) -> Path:
    """Where the text encoder file of a checkpoint written to ``checkpoint`` goes: the
    ``text_encoders`` folder beside ComfyUI's ``checkpoints`` folder when it is written there, else a
    ``text_encoders`` folder inside its own folder (as ``--models`` folders are searched)."""
    path = Path(checkpoint).expanduser()
    root = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return root / "text_encoders" / f"{path.stem}-text.safetensors"


def _checked_text_encoder_out(name: str, checkpoint: Path, text_encoder_out: str | os.PathLike | None) -> Path:
    """Where model ``name``'s text encoder file goes (``text_encoder_out``, default beside
    ``checkpoint``), refused where it is the checkpoint itself: the later write would replace it."""
    path = checked_out_path(text_encoder_out or text_encoder_path(checkpoint))
    if path.resolve() == checkpoint.resolve():
        example = str(text_encoder_path(checkpoint))
        raise UserError(f"--text-encoder-out {str(path)!r} is the checkpoint's own path (--out): the checkpoint would "
                        f"replace {name}'s text encoder; give the text encoder a file of its own, e.g. {example!r}")
    return path


def write_checkpoint(
    name: str, out: str | os.PathLike, *, seed: int = 0, dtype: str = "fp16", progress: bool = False,
    text_encoder_out: str | os.PathLike | None = None,
) -> CheckpointSummary:
    """Write the checkpoint of model ``name`` (one of ``MODEL_NAMES``) to ``out`` (a .safetensors
    file) and describe it. Peak memory is one tensor; the file appears only when complete.

    A family whose text encoders live apart (Flux) also gets its text encoder file, written first
    to ``text_encoder_out`` (default ``text_encoder_path(out)``, never ``out`` itself); the summary counts
    both files. Any other model refuses ``text_encoder_out``: its text encoders are in the checkpoint."""
    # sdopt_size holds the model name (SD1.5's are its bare sizes, so their files stay as they were).
    metadata = {"format": "pt", "sdopt_size": name, "sdopt_seed": str(seed), "sdopt_dtype": dtype}
    text_specs = separate_text_encoder_specs(name)
    if not text_specs and text_encoder_out is not None:
        family, _ = resolve_model(name)
        raise UserError(f"--text-encoder-out: {name} ({family.title}) has no text encoder file of its own, its text "
                        "encoders are inside the checkpoint; drop --text-encoder-out")
    # Checked before the text encoder file is written: a refused checkpoint path must not leave it behind.
    path = checked_out_path(out)
    text_file = None
    if text_specs:
        text_file, text_specs = write_safetensors(
            text_specs, _checked_text_encoder_out(name, path, text_encoder_out), {**metadata, "sdopt_part": "text_encoders"},
            seed=seed, dtype=dtype, desc=f"sdopt {name} text encoder", progress=progress,
        )
    path, specs = write_safetensors(
        checkpoint_specs(name), path, metadata, seed=seed, dtype=dtype, desc=f"sdopt {name} checkpoint",
        progress=progress, given=given_tensors(name),
    )
    file_bytes = path.stat().st_size + (text_file.stat().st_size if text_file else 0)
    return CheckpointSummary(path, name, seed, dtype, len(specs) + len(text_specs),
                             param_count(specs) + param_count(text_specs), file_bytes, text_file)


def ensure_checkpoint(name: str, out: str | os.PathLike, *, text_encoder_out: str | os.PathLike | None = None,
                      progress: bool = False) -> Path:
    """``out``, written (seed 0, fp16) where it or its family's separate text encoder file
    (``text_encoder_out``, default ``text_encoder_path(out)``) is missing."""
    family, size = resolve_model(name)
    path = Path(out)
    text_encoder = Path(text_encoder_out or text_encoder_path(path)) if family.text_encoder_filename(size) else None
    if not path.exists() or (text_encoder is not None and not text_encoder.exists()):
        write_checkpoint(name, path, seed=0, dtype="fp16", progress=progress, text_encoder_out=text_encoder)
    return path
