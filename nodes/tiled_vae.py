"""SDOptTiledVAE (VAE → VAE): the stock VAEDecode and VAEEncode run tile by tile, matching untiled.

The returned copy's decode/encode call what they wrapped (ComfyUI's own method, or another sdopt
node's wrapper) on a stand-in VAE whose autoencoder decodes and encodes through
``optim.tiled_vae``; ComfyUI's batching, dtype, device and output handling stay as they are.
Downstream of sdopt VAE Precision, a NaN-guard redo decodes with that node's own (untiled) copy;
upstream of it, the redo tiles too. ComfyUI's own tiled decode/encode (VAE Decode (Tiled)) is left
to ComfyUI.
"""
import copy
import functools

from ..errors import UserError
from ..measure.record import record
from ..optim.tiled_vae import DECODE, ENCODE, TiledVAEConfig, UnsupportedVAE, check_overlap, check_tile, tiled_decode, tiled_encode, unsupported_reason
from . import environment, patching, prompt_context
from .base import PatchNode

NODE = "SDOptTiledVAE"


def _problem(tile, overlap) -> str | None:
    """The first input's problem, each message naming its own input (the node base has held each value to
    its INPUT_TYPES already: a budget_mb below 0 stops there)."""
    return check_tile(tile) or check_overlap(overlap, tile)


class _TilingAutoencoder:
    """Stands in for ``first_stage_model`` during one call: decode and encode tile; anything else is the module's."""

    def __init__(self, model, config: TiledVAEConfig, calls: list):
        self._model, self._config, self._calls = model, config, calls

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode(self, z, **kwargs):
        return self._untiled(DECODE, z, kwargs) if kwargs else self._tiled(tiled_decode, DECODE, z)

    def encode(self, pixels, **kwargs):
        return self._untiled(ENCODE, pixels, kwargs) if kwargs else self._tiled(tiled_encode, ENCODE, pixels)

    def _untiled(self, kind, x, kwargs):
        # ComfyUI passes keywords (device=) only to VAEs that chunk their own input and output (video VAEs).
        self._calls.append(f"{kind}: untiled, ComfyUI called it with {', '.join(sorted(kwargs))}=, the call of a VAE that "
                           "chunks its own input and output")
        return getattr(self._model, kind)(x, **kwargs)

    def _tiled(self, verb, kind, x):
        import comfy.utils

        bar = comfy.utils.ProgressBar(1)
        try:
            result = verb(self._model, x, self._config, lambda done, total: bar.update_absolute(done, total))
        except UnsupportedVAE as error:
            self._calls.append(f"{kind}: untiled, this VAE is not supported ({error})")
            return getattr(self._model, kind)(x)
        self._calls.append(f"{kind}: {result.stats.describe()}")
        return result.output


class SDOptTiledVAE(PatchNode):
    DESCRIPTION = (
        "Makes VAE Decode and VAE Encode run tile by tile, so big images fit in little memory. GroupNorm sees the "
        "whole image, so the result matches the untiled one, with no seams."
    )
    PATCHES = "VAE"
    FUNCTION = "apply"

    @classmethod
    def inputs(cls):
        return {
            "tile": ("INT", {"default": 0, "min": 0, "max": 16384, "step": 8, "tooltip": (
                "Tile side in image pixels (decode output, encode input): a multiple of 8, at least 64. "
                "0 = auto: the largest tile that fits budget_mb.")}),
            "overlap": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 8, "tooltip": (
                "Image pixels cross-faded between neighbouring tiles (a multiple of 8, below tile). Seams are exact "
                "without it: every tile computes the halo its convolutions need.")}),
            "only_when_needed": ("BOOLEAN", {"default": True, "tooltip": (
                "Tile only when the untiled decode/encode is estimated not to fit budget_mb; otherwise run it untiled.")}),
            "budget_mb": ("INT", {"default": 0, "min": 0, "max": 1 << 20, "step": 64, "tooltip": (
                "Memory the decode/encode may use, in MiB. 0 = the device's free memory when the call starts "
                "(VRAM on a GPU, RAM on a CPU).")}),
        }

    # ComfyUI files a VALIDATE_INPUTS failure under every input the method takes, so it takes only
    # tile: overlap (which needs tile too) and budget_mb are checked when the node runs, and a
    # negative budget_mb already fails ComfyUI's own minimum check, under its own name.
    @classmethod
    def VALIDATE_INPUTS(cls, tile):
        if tile is None:  # a linked input: checked when the node runs
            return True
        return check_tile(tile) or True

    def apply(self, vae, tile, overlap, only_when_needed, budget_mb):
        problem = _problem(tile, overlap)
        if problem:
            raise UserError(problem)
        if getattr(vae, "first_stage_model", None) is None:
            raise UserError("vae: this VAE has no weights (the checkpoint holds no VAE); load one with a VAE loader")
        config = TiledVAEConfig(tile=tile or None, overlap=overlap, only_when_needed=only_when_needed,
                                budget_bytes=budget_mb * 2**20 if budget_mb else None,
                                free_bytes=functools.partial(environment.free_for_work, patcher=getattr(vae, "patcher", None)))
        requested = (f"tile={tile or 'auto'}, overlap={overlap}, only_when_needed={'on' if only_when_needed else 'off'}, "
                     f"budget={f'{budget_mb} MiB' if budget_mb else 'free memory'}")
        tallies = {}

        def wrap(name, inner):
            if name not in (DECODE, ENCODE):
                return inner

            def call(self, *args, **kwargs):
                calls = []
                stand_in = copy.copy(self)
                stand_in.first_stage_model = _TilingAutoencoder(self.first_stage_model, config, calls)
                output = inner(stand_in, *args, **kwargs)
                if calls:  # one entry per kind, the last call's, for the prompt being run
                    tally = tallies.setdefault(prompt_context.current_prompt_id(), {})
                    tally[name] = calls[-1] + (f" (x{len(calls)} batches)" if len(calls) > 1 else "")
                    record(prompt_context.prompt_log().records, NODE, requested, "; ".join(tally[k] for k in sorted(tally)))
                return output

            return call

        out = patching.wrap_vae_methods(vae, wrap)
        reasons = {kind: unsupported_reason(vae.first_stage_model, kind) for kind in (DECODE, ENCODE)}
        active = "; ".join(f"{kind}: untiled, not supported ({why})" for kind, why in reasons.items() if why)
        patching.record_vae(out, NODE, requested, active or "tiled per call (the report shows each call's tiles)")
        return (out,)
