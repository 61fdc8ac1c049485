"""diffusers' own UNet and pipeline over a generated checkpoint's weights: what a user would run instead of ComfyUI.

The UNet is built from ``modelgen.diffusers_unet_config`` (nothing comes from a hub) and given the
checkpoint's own weights through diffusers' single-file key conversion; then diffusers' recommended
recipe for speed: fp16 (on CUDA; fp32 on a CPU, where fp16 kernels are slow), SDPA attention,
channels-last memory format and, for the compiled variant, ``torch.compile(mode="max-autotune",
fullgraph=True)``. The pipeline is diffusers' StableDiffusionPipeline, or StableDiffusionXLPipeline
where the UNet takes a text-time vector (read from its config), with diffusers' Euler scheduler on the
checkpoint's noise schedule. It samples from prompt embeddings and noise that the caller gives (the
bench passes ComfyUI's, so both sides start from the same inputs), returns the latent, and is timed
per step by ``measure.profiler.SamplingRun`` like ComfyUI's sampler is.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..measure.profiler import SamplingRun
from ..measure.record import record

RECIPE = "fp16, SDPA, channels-last"
COMPILE_RECIPE = "torch.compile(mode='max-autotune', fullgraph=True)"
NODE = "diffusers"


@dataclass(frozen=True)
class NoiseSchedule:
    """A discrete DDPM schedule (SD1.5, SDXL): betas spaced linearly in their square root."""

    num_timesteps: int = 1000
    linear_start: float = 0.00085
    linear_end: float = 0.012


def unavailable_reason(model: str) -> str | None:
    """Why the diffusers rungs cannot run for ``model``, or None."""
    if importlib.util.find_spec("diffusers") is None:
        return "diffusers is not installed (pip install diffusers, or sdopt[diffusers])"
    from .modelgen import SIZES

    if model not in SIZES:
        return f"the UNet config comes from a generated model's name ({', '.join(SIZES)}); {model!r} is a file"
    return None


def load_unet(checkpoint: Path, model: str):
    """diffusers' ``UNet2DConditionModel`` of ``model``'s config with the checkpoint's UNet weights (fp32, CPU)."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    from safetensors import safe_open

    from .modelgen import UNET_PREFIX, diffusers_unet_config

    config = diffusers_unet_config(model)
    with safe_open(str(checkpoint), "pt") as file:
        weights = {key: file.get_tensor(key).float() for key in file.keys() if key.startswith(UNET_PREFIX)}
    converted = convert_ldm_unet_checkpoint(weights, config)
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    missing, unexpected = unet.load_state_dict(converted, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"{checkpoint.name} does not fit the diffusers UNet of {model}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return unet.eval()


def build_pipeline(unet, schedule: NoiseSchedule):
    """The pipeline around ``unet`` (its text-time vector picks SDXL's), without text encoders or VAE."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=schedule.num_timesteps, beta_start=schedule.linear_start, beta_end=schedule.linear_end,
        beta_schedule="scaled_linear", prediction_type="epsilon", timestep_spacing="linspace", steps_offset=1)
    if unet.config.get("addition_embed_type") == "text_time":
        return StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                                         unet=unet, scheduler=scheduler)
    return StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


@dataclass
class DiffusersSampler:
    """One configured pipeline: ``sample`` runs it like one KSampler prompt."""

    pipeline: object
    label: str
    device: torch.device
    dtype: torch.dtype
    recipe: str

    def sample(self, positive: dict, negative: dict, noise: torch.Tensor, steps: int, cfg: float) -> tuple[torch.Tensor, dict, float]:
        """(the latent in the pipeline's scaled space, the run as ``RunResult.to_dict()``, seconds from
        call to return). ``positive``/``negative``: ``embeds`` [B, 77, C] and, for SDXL, ``pooled``."""
        records = []
        record(records, NODE, self.label, self.recipe)
        run = SamplingRun(self.label, self.device, records)
        height, width = (n * self.pipeline.vae_scale_factor for n in noise.shape[-2:])
        arguments = dict(prompt_embeds=positive["embeds"].to(self.device, self.dtype),
                         negative_prompt_embeds=negative["embeds"].to(self.device, self.dtype))
        if self.pipeline.unet.config.get("addition_embed_type") == "text_time":  # SDXL's pooled text in its y vector
            arguments.update(pooled_prompt_embeds=positive["pooled"].to(self.device, self.dtype),
                             negative_pooled_prompt_embeds=negative["pooled"].to(self.device, self.dtype))

        def step(_pipeline, _index, _timestep, tensors):
            run.step()
            return tensors

        started = time.perf_counter()
        with torch.inference_mode(), run.memory_scope():
            run.start()
            latents = self.pipeline(**arguments, height=height, width=width, num_inference_steps=steps, guidance_scale=cfg,
                                    latents=noise.to(self.device, self.dtype), output_type="latent", callback_on_step_end=step,
                                    return_dict=False)[0]
            run.finish()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return latents.float().cpu(), run.result().to_dict(), time.perf_counter() - started


def build_samplers(checkpoint: Path, model: str, device: torch.device | str, schedule: NoiseSchedule,
                   compiled: tuple[bool, ...]) -> list[DiffusersSampler]:
    """The recipe's samplers for ``model``'s UNet with ``checkpoint``'s weights on ``device``, one per
    entry of ``compiled`` (plain, or through torch.compile); they share one UNet on the device."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    reason = unavailable_reason(model)
    if reason:
        raise UserError(f"--rungs diffusers: {reason}")
    device = torch.device(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    unet = load_unet(Path(checkpoint), model).to(device, dtype, memory_format=torch.channels_last)
    unet.set_attn_processor(AttnProcessor2_0())
    recipe = RECIPE if dtype == torch.float16 else RECIPE.replace("fp16", "fp32 (on a CPU)")
    samplers = []
    for compile_it in compiled:
        pipeline = build_pipeline(torch.compile(unet, mode="max-autotune", fullgraph=True) if compile_it else unet, schedule)
        pipeline.set_progress_bar_config(disable=True)
        samplers.append(DiffusersSampler(pipeline, f"diffusers{'+compile' if compile_it else ''}", device, dtype,
                                         recipe + (f", {COMPILE_RECIPE}" if compile_it else "")))
    return samplers
