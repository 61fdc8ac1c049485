"""The stages a plan predicts, the offload modes it considers, and the settings each stage may run
under, fastest first."""
from __future__ import annotations

from dataclasses import dataclass

from ...optim.lowmem import LowMemConfig
from ...measure.memory_model import MemoryPlanConfig

TEXT_ENCODE, UNET_STEP, VAE_DECODE, VAE_ENCODE = "text encode", "UNet step", "VAE decode", "VAE encode"
STAGES = (TEXT_ENCODE, UNET_STEP, VAE_DECODE, VAE_ENCODE)
# none: all three models resident; model: only the running stage's (ComfyUI unloads the others when
# short); sequential: that, with the UNet streamed layer by layer (sdopt Offload's sequential mode)
OFFLOADS = ("none", "model", "budget", "sequential")
PROMPT_TOKENS = 77
MIB = 2**20
# The parts of a model; "text_encoder" stands for all of a family's text encoders.
PARTS = ("text_encoder", "unet", "vae")
STAGE_MODEL = {TEXT_ENCODE: "text_encoder", UNET_STEP: "unet", VAE_DECODE: "vae", VAE_ENCODE: "vae"}


@dataclass(frozen=True)
class Setting:
    """One way to run a stage: a name for the table, the predictor's config and, for the VAE, a tile."""

    name: str
    config: MemoryPlanConfig = MemoryPlanConfig()
    tile: int | None = None  # VAE tile side in image pixels; None = untiled


def lowmem_setting(budget_mib: int, attention: str = "sdpa") -> Setting:
    budget = budget_mib * MIB
    return Setting(f"low memory {budget_mib} MiB, {attention}",
                   MemoryPlanConfig(attention=attention, attention_budget_bytes=budget,
                                    low_memory=LowMemConfig(budget_bytes=budget)))


# Fastest first. sdpa's own kernels (flash on CPU and CUDA) already keep attention linear in the
# tokens; sub_quadratic is for hosts whose sdpa falls back to the math kernel.
UNET_SETTINGS = (
    Setting("sdpa, CFG batch 2"),
    Setting("sdpa, sequential CFG", MemoryPlanConfig(low_memory=LowMemConfig(
        budget_bytes=2**62, chunk_groupnorm=False, slice_convs=False, slice_feedforward=False))),
    lowmem_setting(256),
    lowmem_setting(64),
    lowmem_setting(64, "sub_quadratic"),
)
VAE_SETTINGS = (
    Setting("untiled, sdpa"),
    Setting("tiled 512 px", tile=512),
    Setting("tiled 256 px", tile=256),
)
TEXT_SETTINGS = (Setting("sdpa"),)
# The low-memory settings: the table's second column and what the largest-size search runs with.
SEARCH_SETTINGS = {TEXT_ENCODE: TEXT_SETTINGS[0], UNET_STEP: UNET_SETTINGS[3], VAE_DECODE: VAE_SETTINGS[-1],
                   VAE_ENCODE: VAE_SETTINGS[-1]}
SETTINGS = {TEXT_ENCODE: TEXT_SETTINGS, UNET_STEP: UNET_SETTINGS, VAE_DECODE: VAE_SETTINGS, VAE_ENCODE: VAE_SETTINGS}
