"""A model step's memory predicted on ComfyUI's own model, without running it: the diffusion model's
``apply_model`` traced on fake tensors (``measure.memory_model``), its weights replaced by fakes of the same
shapes for the call only, its inputs made by the model's own ``extra_conds`` from the sampler's
conditionings, and the APPLY_MODEL wrappers and attention override of a patched copy (Low Memory's,
Attention's) in force, so the prediction runs what that copy would run."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..measure.memory_model import MemoryPlanConfig, fake_tensor_mode, predict_peak
from .patching import wrapper_types
from .stack_choice import StepPrediction


class _ApplyModel(nn.Module):
    """``apply_model`` of a ComfyUI model as a module's forward, so ``functional_call`` can lend it weights."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, t, transformer_options, conds):
        return self.model.apply_model(x, t, transformer_options=transformer_options, **conds)


def call_batch(noise_shape: torch.Size, cfg: float, model_options: dict) -> int:
    """The rows of one model call: the latent's batch, twice where CFG runs an uncond part."""
    skips_uncond = math.isclose(cfg, 1.0) and not model_options.get("disable_cfg1_optimization", False)
    return noise_shape[0] * (1 if skips_uncond else 2)


def step_conds(model, conds: list[dict], noise_shape: torch.Size, batch: int) -> dict:
    """The model inputs beside the latent and timestep for one call of ``batch`` rows, as ComfyUI makes them
    from the sampler's positive conditionings (``encode_model_conds`` over the model's ``extra_conds``),
    made on the CPU from a zero latent of ``noise_shape`` (small: the latent, not the image)."""
    import comfy.samplers

    noise = torch.zeros(noise_shape)
    encoded = comfy.samplers.encode_model_conds(model.extra_conds, [dict(c) for c in conds[:1]], noise, torch.device("cpu"),
                                                "positive", latent_image=noise, denoise_mask=None, seed=0)
    return {name: cond.process_cond(batch_size=batch, area=None).cond for name, cond in encoded[0]["model_conds"].items()}


def predict_step(patched, conds: dict, noise_shape: torch.Size, batch: int, device: torch.device) -> StepPrediction:
    """One model call of ``patched`` (a ModelPatcher) at ``batch`` rows of ``noise_shape``'s latent, on
    ``device``: its APPLY_MODEL wrappers and transformer options in force, its weights fake."""
    mode = fake_tensor_mode()
    call = _ApplyModel(patched.model)
    kinds = wrapper_types()
    options = {name: value for name, value in patched.model_options.get("transformer_options", {}).items() if name != "wrappers"}
    options["wrappers"] = {kinds.APPLY_MODEL: {key: list(fns) for key, fns in patched.wrappers.get(kinds.APPLY_MODEL, {}).items()}}
    options["cond_or_uncond"] = [0, 1] if batch > noise_shape[0] else [0]
    with mode:
        weights = {f"model.{name}": torch.empty(t.shape, dtype=t.dtype, device=device)
                   for name, t in [*patched.model.named_parameters(), *patched.model.named_buffers()]}
        x = torch.empty((batch, *noise_shape[1:]), device=device)
        t = torch.empty((batch,), device=device)
        fake_conds = {name: torch.empty(value.shape, dtype=value.dtype, device=device) if isinstance(value, torch.Tensor) else value
                      for name, value in conds.items()}
    options["sigmas"] = t

    def step(x, t, conds):
        return torch.func.functional_call(call, weights, (x, t, options, conds), tie_weights=False, strict=False)

    estimate = predict_peak(step, x, t, fake_conds, mode=mode, config=MemoryPlanConfig(workspace="cuda" if torch.device(device).type == "cuda" else "cpu"))
    inputs = sum(v.numel() * v.element_size() for v in (x, t, *fake_conds.values()) if isinstance(v, torch.Tensor))
    return StepPrediction(estimate.peak_bytes, inputs, estimate.allocated_bytes)
