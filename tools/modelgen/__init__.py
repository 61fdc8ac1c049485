"""Deterministic random-weight checkpoints in the original single-file layout of each model family.

No weights can be downloaded, so sdopt writes its own. What a checkpoint holds comes from
``families``: the family's ``CheckpointConfig`` for the model name (``mini``, ``sdxl-mini``, ...)
gives the diffusion model (``model.diffusion_model.*``: the LDM UNet, SD3's MMDiT or Flux), the text encoders (HF CLIP under their prefix,
e.g. ``cond_stage_model.transformer.text_model.*``, or OpenCLIP's format, SDXL's
``conditioner.embedders.1.model.*``) and the LDM AutoencoderKL (``first_stage_model.*``, Flux's
``vae.*``), written into one safetensors file; Flux's text encoder goes into a file of its own. Per family, ``tiny`` is small for unit tests (not loadable by ComfyUI),
``mini`` is a smaller UNet that ComfyUI still detects as the family, with the text encoders and
VAE at full size (ComfyUI fixes their shapes), ``full`` has the real shapes.

Each tensor depends only on (seed, key), so a given seed always gives the same file. One subject per
module:

- ``specs``: a tensor's shape and initial distribution, the builder of a module's tensors, the tensor itself;
- ``unet``, ``mmdit``, ``flux``: one diffusion model architecture each, its state dict and the diffusers
  config matching it; a new architecture is a module beside them, picked in ``architectures`` by its
  config's type;
- ``text_encoders``, ``vae``: the other parts, the same way;
- ``files``: streaming tensors into a safetensors file that appears only when complete;
- ``checkpoint``: a model name's checkpoint (and separate text encoder file), written or ensured;
- ``lora``: a LoRA for a model name in kohya's format.
"""
from ...families import UNET_PREFIX
from .architectures import diffusers_diffusion_model, diffusion_model_specs
from .checkpoint import SIZES, checkpoint_specs, ensure_checkpoint, separate_text_encoder_specs, text_encoder_path, write_checkpoint
from .files import CHECKPOINT_DTYPES
from .lora import lora_specs, write_lora
from .specs import generate_tensor, param_count
from .text_encoders import clip_text_specs, text_encoder_specs, transformers_clip_text_config
from .unet import diffusers_unet_config, unet_ldm_specs
from .vae import FP16_OVERFLOW_CONV, FP16_OVERFLOW_SCALE, diffusers_vae_config, vae_ldm_specs

__all__ = [
    "CHECKPOINT_DTYPES", "FP16_OVERFLOW_CONV", "FP16_OVERFLOW_SCALE", "SIZES", "UNET_PREFIX", "checkpoint_specs",
    "clip_text_specs", "diffusers_diffusion_model", "diffusers_unet_config", "diffusers_vae_config",
    "diffusion_model_specs", "ensure_checkpoint", "generate_tensor", "lora_specs", "param_count",
    "separate_text_encoder_specs", "text_encoder_path", "text_encoder_specs", "transformers_clip_text_config",
    "unet_ldm_specs", "vae_ldm_specs", "write_checkpoint", "write_lora",
]
