"""SDOptVAEPrecision (VAE → VAE): the VAE's dtype, on a copy, and a NaN guard.

The guard redoes a decode or encode whose output has NaN/Inf (the fp16 black image) in a safer
dtype, with weights converted from the node's input VAE, and counts every redo in the report. Every
copy converts the VAE's weights as they were before any sdopt copy, so chained nodes round once.
"""
from collections import Counter

import torch

from ..errors import UserError
from ..measure.profiler import format_mib
from ..measure.record import record
from ..optim.precision import AUTO, COMPUTE_DTYPES, check_compute_dtype, converted_copy, dtype_name, parse_dtype, pick_dtype, run_with_nan_guard, safe_dtype, weight_bytes
from . import patching, private_copy, prompt_context
from .base import PatchNode
from .inputs import DEFAULT


NODE = "SDOptVAEPrecision"


def _in_dtype(vae, dtype: torch.dtype, notes: list[str] | None = None):
    copied = private_copy.private_vae_copy(vae, lambda module: converted_copy(module, dtype, leave_out=private_copy.DYNAMIC_VRAM_LAYER_STATE), notes)
    copied.vae_dtype = dtype
    return copied


def _guarded(vae, source, requested: str, active: str):
    """``vae`` with decode/encode redone in a safer dtype on NaN/Inf; VAEs in those dtypes come from ``source``."""
    safe_vaes, tally = {source.vae_dtype: source}, {}

    def wrap(method, inner):
        def guarded(self, *args, **kwargs):
            result = run_with_nan_guard(
                lambda: inner(self, *args, **kwargs),
                lambda dtype: getattr(safe_vaes.get(dtype) or safe_vaes.setdefault(dtype, _in_dtype(source, dtype)), method)(*args, **kwargs),
                self.vae_dtype, self.device)
            counts, last = tally.setdefault(prompt_context.current_prompt_id(), (Counter(), {}))
            if result.redone or not result.finite:
                counts[(f"redid {{}} in {dtype_name(result.redone_in[-1])}" if result.redone else "could not redo {}", method.split("_")[0])] += 1
                last["note"] = f"last {method}: {result.describe()}"
                last["nonfinite"] = last.get("nonfinite", 0) + (not result.finite)
            if counts:  # every call re-files the node's plain record first, so the prompt's count goes back on top
                done = "; ".join(text.format(f"{n} {op}{'s' * (n > 1)}") for (text, op), n in sorted(counts.items()))
                failed = last.get("nonfinite", 0)
                short = f"NaN/Inf left in {failed} output(s), redone or not" if failed else ""
                record(prompt_context.prompt_log().records, NODE, requested, f"{active} (NaN guard {done})", last["note"], short)
            return result.output
        return guarded

    return patching.wrap_vae_methods(vae, wrap)


class SDOptVAEPrecision(PatchNode):
    DESCRIPTION = (
        "Sets the VAE's dtype on a copy (auto: fp16 on CUDA, bf16 or fp32 on a CPU by measurement). nan_guard "
        "redoes a decode or encode that gives NaN or Inf, the black image, in a safer dtype."
    )
    PATCHES = "VAE"
    FUNCTION = "apply"

    @classmethod
    def inputs(cls):
        return {
            "dtype": ([AUTO, DEFAULT, *COMPUTE_DTYPES], {"default": AUTO, "tooltip": (
                "The VAE's dtype. auto: fp16 on CUDA, on a CPU bf16 where it measured faster than fp32, else fp32. "
                "default: as loaded.")}),
            "nan_guard": ("BOOLEAN", {"default": True, "tooltip": "Redo a decode/encode whose output has NaN/Inf in a safer dtype (bf16, else fp32)."}),
        }

    def apply(self, vae, dtype, nan_guard):
        if getattr(vae, "first_stage_model", None) is None:
            raise UserError("vae: this VAE has no weights (the checkpoint holds no VAE); load one with a VAE loader")
        notes = []
        if dtype == AUTO:
            pick = pick_dtype(vae.device)
            target = pick.dtype
            notes.append(f"auto: {pick.reason}")
        else:
            target = vae.vae_dtype if dtype == DEFAULT else parse_dtype(dtype, "dtype", COMPUTE_DTYPES)
        check_compute_dtype(target, vae.device, "dtype")
        out = patching.copy_vae(vae) if target == vae.vae_dtype else _in_dtype(vae, target, notes)
        if out.first_stage_model is not vae.first_stage_model:
            before, after = weight_bytes(vae.first_stage_model), weight_bytes(out.first_stage_model)
            notes.append(f"VAE weights {format_mib(before)} → {format_mib(after)} MiB in a copy; the input VAE is unchanged")
        requested, active = f"dtype={dtype}, nan_guard={'on' if nan_guard else 'off'}", dtype_name(target)
        if nan_guard:
            safer = safe_dtype(target, vae.device)
            active += f" (NaN guard redoes NaN/Inf in {dtype_name(safer)})" if safer else ""
            notes += [] if safer else ["the NaN guard can only report NaN/Inf: nothing is safer than fp32"]
            out = _guarded(out, vae, requested, dtype_name(target))
        else:  # a copy whose decode/encode file its record into the prompt, as the guarded one does
            out = patching.wrap_vae_methods(out, lambda _name, inner: inner)
        patching.record_vae(out, NODE, requested, active, "; ".join(notes))
        return (out,)
