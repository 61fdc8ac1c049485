"""``python -m sdopt plan``: predicted peak memory of each stage of a model and the settings that fit a budget.

The model is one that sdopt generates (``mini``, ``sdxl-mini``, ``sd35-mini``, ``flux-mini``, ...:
its family's description in ``families/``) or the architecture of a checkpoint file among those.
Its text encoders, diffusion model and VAE are built from ``modelgen``'s configs (diffusers'
``UNet2DConditionModel``, ``SD3Transformer2DModel`` or ``FluxTransformer2DModel`` as the family's
diffusion model config says, ``AutoencoderKL``, transformers' ``CLIPTextModel`` and, for encoders
with a projection, ``CLIPTextModelWithProjection``) on the meta device and given fake weights, so
nothing is allocated and nothing runs. The diffusion model is the ``unet`` part and its stage the
"UNet step" for every family. The text encode stage runs every text encoder of the family, those of
the checkpoint and those of its own file (Flux's CLIP-L), one after the other; no T5, which sdopt
does not generate. The UNet step takes the family's vector input where it has one (SDXL's ``y``:
diffusers' ``added_cond_kwargs``, the pooled text and the size and crop ids); a diffusion
transformer's step takes the latent, the text tokens and the pooled text as diffusers does, Flux's
also the token positions and the guidance where it has a guidance embedder. ``memory`` traces each
stage (text encode, one UNet step with CFG, VAE decode, VAE encode) at the requested size under
each candidate setting, fastest first. A stage needs its weights resident (all three models; with
``model`` offload only its own; with ``budget``, sdopt Offload's mode, the UNet step holds as much of
the UNet as the budget leaves beside the step's inputs and working peak (plus ``PLANNER_TOLERANCE`` of
it, the planner's own accuracy) and streams the rest; with
``sequential`` only the few layers being streamed), its inputs, and its working peak. ``budget`` fits
wherever ``sequential`` does and streams less, so the plan says ``sequential`` only where the budget
leaves no more than the streamed layers.

One subject per module:

- ``memory``: the peak memory of a call predicted on fake tensors (``predict_peak``), and byte sizes;
- ``settings``: the stages, the offload modes, the settings each stage may run under;
- ``models``: the model's architecture (a name or a checkpoint's keys) and its modules;
- ``stages``: one stage of a model as a function and its inputs;
- ``planner``: the predictions, the plan that fits a budget and its table;
- ``check`` (``plan --check``) and ``real_stage``: the predictions against stages run for real, each in a
  fresh process (``real_stage`` is that process's module, so nothing here imports it);
- ``command``: the ``plan`` command.
"""
from .check import check_predictions, check_table, measure_stage
from .command import run_plan
from .models import architecture, architecture_of_shapes, build_modules, text_encoder_names, text_encoders
from .planner import Planner, StagePrediction, budget_resident_bytes, make_plan, plan_table
from .settings import SETTINGS, TEXT_ENCODE, UNET_SETTINGS, UNET_STEP, VAE_DECODE, VAE_SETTINGS, lowmem_setting
from .stages import pack_latent, stage_call, unpack_latent

__all__ = [
    "Planner", "SETTINGS", "StagePrediction", "TEXT_ENCODE", "UNET_SETTINGS", "UNET_STEP",
    "VAE_DECODE", "VAE_SETTINGS", "architecture", "architecture_of_shapes", "budget_resident_bytes", "build_modules",
    "check_predictions", "check_table", "lowmem_setting", "make_plan", "measure_stage", "pack_latent", "plan_table",
    "run_plan", "stage_call", "text_encoder_names", "text_encoders", "unpack_latent",
]
