"""The diffusion-model weights of the reference models, trained here and shipped with sdopt: where they
live, how they are stored (int8 with a scale per output row, so all of them fit the repository's
budget) and the sha256 each shipped file must have.

The stored tensors are the reference: ``make-model ref-sd15`` writes their dequantized values, and every
quality figure is measured on those, never on the float weights training ended with.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...errors import UserError

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "reference" / "weights"
# What `python -m sdopt train-reference <model>` wrote last; a retrain updates these.
WEIGHTS_SHA256: dict[str, str] = {
    "ref-sd15": "59fd2678ab2c546521c0fb0886796333d4572d7964b1d2dd84ab952b9d6c50dc",
    "ref-sd35": "b5727985712d03a37eb8a9c74123f82218a9295bb26dc95666f5a1b09a1bd0a1",
}
_SCALE_SUFFIX = ".int8_scale"


def weights_path(model: str) -> Path:
    return WEIGHTS_DIR / f"{model}.safetensors"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def quantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 weights with an fp32 scale per output row (symmetric, round to nearest) for every tensor of
    two or more dimensions; the rest (biases, norms) as fp16."""
    stored: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        tensor = tensor.detach().float().cpu()
        if tensor.dim() < 2:
            stored[key] = tensor.half()
            continue
        rows = tensor.reshape(tensor.shape[0], -1)
        scale = rows.abs().amax(dim=1).clamp_min(1e-12) / 127
        stored[key] = (rows / scale[:, None]).round().clamp(-127, 127).to(torch.int8).reshape(tensor.shape)
        stored[key + _SCALE_SUFFIX] = scale
    return stored


def dequantized(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 weights that ``quantized`` stored."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in stored.items():
        if key.endswith(_SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.int8:
            scale = stored[key + _SCALE_SUFFIX]
            state[key] = (tensor.reshape(tensor.shape[0], -1).float() * scale[:, None]).reshape(tensor.shape)
        else:
            state[key] = tensor.float()
    return state


def save_trained(model: str, state: dict[str, torch.Tensor], path: Path | None = None) -> Path:
    """Store a trained diffusion model's state dict (ComfyUI's keys, without ``model.diffusion_model.``);
    the file appears only when complete."""
    path = path or weights_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        save_file(quantized(state), temp, metadata={"sdopt_model": model, "format": "pt"})
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path


def load_trained(model: str, path: Path | None = None) -> dict[str, torch.Tensor]:
    """The shipped diffusion-model weights of reference model ``model``, fp32, checked against the sha256
    the code expects (a retrain updates ``WEIGHTS_SHA256``)."""
    path = path or weights_path(model)
    retrain = f"python -m sdopt train-reference {model}"
    if not path.exists():
        raise UserError(f"{model}'s trained weights are missing ({path}): restore them from the repository or run {retrain}")
    expected = WEIGHTS_SHA256.get(model)
    if path == weights_path(model) and expected is not None and file_sha256(path) != expected:
        raise UserError(f"{path} is not the file sdopt expects for {model} (sha256 differs): restore it from the "
                        f"repository, or after {retrain} put its sha256 in tools/modelgen/trained.py")
    return dequantized(load_file(path))
