"""Per-model weight offload: how much of one model's weights stays on the compute device.

The technique is a policy, not a mover: the host's model management moves the weights and streams
the non-resident layers (ComfyUI casts each such layer to the device on a side stream as it runs);
``plan_residency(config, model_bytes, loaded_bytes)`` says what to load or free after the host has
loaded the model for sampling, and whether to free everything when sampling ends.

Modes:

- ``none``: every weight resident;
- ``budget``: at most ``budget_bytes`` resident, the rest streamed per layer;
- ``sequential``: nothing resident that can be streamed (least memory, slowest);
- ``unload_after``: load as the host likes, then free the weights from the device after sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Unavailable, UserError

MODES = ("none", "budget", "sequential", "unload_after")
MIB = 2**20


@dataclass(frozen=True)
class OffloadConfig:
    """``mode`` is one of ``MODES``; ``budget_bytes`` counts only in ``budget`` mode."""

    mode: str = "budget"
    budget_bytes: int = 1024 * MIB

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "budget" and self.budget_bytes < 0:
            raise UserError(f"budget_mb: {self.budget_bytes // MIB} is negative; give the MiB of weights to keep resident")

    def describe(self) -> str:
        return f"budget {self.budget_bytes / MIB:,.0f} MiB" if self.mode == "budget" else self.mode


@dataclass(frozen=True)
class Residency:
    """What to do once the host has loaded ``loaded_bytes`` of a ``model_bytes`` model."""

    resident_bytes: int
    model_bytes: int
    bytes_to_free: int
    bytes_to_load: int
    unload_after: bool

    def summary(self) -> str:
        return residency_summary(self.resident_bytes, self.model_bytes)


def residency_summary(resident_bytes: int, model_bytes: int) -> str:
    streamed = model_bytes - resident_bytes
    resident = f"{resident_bytes / MIB:,.1f} of {model_bytes / MIB:,.1f} MiB of weights resident"
    return resident + (f", {streamed / MIB:,.1f} MiB streamed per layer" if streamed > 0 else "")


def plan_residency(config: OffloadConfig, model_bytes: int, loaded_bytes: int) -> Residency:
    """The residency ``config`` asks for, given what the host loaded (it loads what fits, so a
    budget only ever lowers that; ``none`` loads the rest)."""
    loaded_bytes = min(loaded_bytes, model_bytes)
    if config.mode == "none":
        resident = model_bytes
    elif config.mode == "budget":
        resident = min(loaded_bytes, config.budget_bytes)
    elif config.mode == "sequential":
        resident = 0
    else:
        resident = loaded_bytes
    return Residency(
        resident_bytes=resident,
        model_bytes=model_bytes,
        bytes_to_free=max(0, loaded_bytes - resident),
        bytes_to_load=max(0, resident - loaded_bytes),
        unload_after=config.mode == "unload_after",
    )


def unavailable(config: OffloadConfig, device: torch.device) -> Unavailable | None:
    """Why offload cannot act on ``device``, with the fix, or None."""
    if torch.device(device).type == "cpu":
        return Unavailable("the model runs on the CPU, where its weights already live in RAM: there is nothing to offload",
                           "set mode to none", "mode")
    return None
