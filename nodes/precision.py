"""SDOptPrecision (MODEL → MODEL) and SDOptVAEPrecision (VAE → VAE).

Neither node changes the model or VAE it is given. A compute-dtype change is ComfyUI's
own ``set_model_compute_dtype`` on a clone (per-layer manual cast). A weight-dtype
change needs weights of its own: the input model is unloaded (so its weights are the
unpatched originals; its next use reloads it), the diffusion model is deep-copied with
its weights converted while copying, and the copy gets a new ModelPatcher that carries
over the input's patches, options, wrappers and callbacks. fp8 weights are computed through
ComfyUI's cast-weights path (``comfy_cast_weights``), which upcasts each layer's weight
to the compute dtype on every forward. TF32 is set and restored around each sampling
run by an OUTER_SAMPLE wrapper, because it is a process-wide setting.

The VAE node builds a copy of the VAE with its own converted weights and patcher,
and/or a copy whose decode/encode redo a NaN/Inf result in a safer dtype (the fp16
VAE black-image problem), reporting every redo for the prompt.
"""
from __future__ import annotations

from collections import Counter

import torch

import comfy.model_management
import comfy.patcher_extension

from ..errors import UserError
from ..optim.precision import (
    COMPUTE_DTYPES,
    WEIGHT_DTYPES,
    GuardedRun,
    PrecisionConfig,
    PrecisionPlan,
    check_compute_dtype,
    converted_copy,
    dtype_name,
    parse_dtype,
    plan_precision,
    run_with_nan_guard,
    safe_dtype,
    tf32_scope,
    weight_bytes,
)
from .records import add_optimization_record, current_prompt_id, note_prompt_optimization
from .vae_copy import copy_vae, wrap_vae_methods

NODE = "SDOptPrecision"
VAE_NODE = "SDOptVAEPrecision"
WRAPPER_KEY = "sdopt.precision"
DEFAULT = "default"
MIB = 2**20

# ModelPatcher state that belongs to the model it patches, not to the patching recipe.
_TIED_TO_THE_MODEL = {
    "model",
    "size",
    "load_device",
    "offload_device",
    "weight_inplace_update",
    "backup",
    "object_patches_backup",
    "hook_backup",
    "hook_patches_backup",
    "cached_hook_patches",
    "patches_uuid",
    "parent",
    "is_injected",
}


def _unload_everywhere(module: torch.nn.Module) -> None:
    """Unload every patcher that has ``module`` loaded, so its weights and attributes are the unpatched originals."""
    mm = comfy.model_management
    for loaded in list(mm.current_loaded_models):
        if loaded.model is not None and loaded.model.model is module:
            loaded.model_unload()
            mm.current_loaded_models.remove(loaded)
    if getattr(module, "current_weight_patches_uuid", None) is not None:
        raise RuntimeError("the model still has patched weights after unloading; cannot copy its original weights")


def _rebased(patcher, module: torch.nn.Module):
    """A patcher of ``module`` that carries ``patcher``'s patches, options, wrappers and callbacks."""
    rebased = type(patcher)(module, patcher.load_device, patcher.offload_device, weight_inplace_update=patcher.weight_inplace_update)
    for name, value in vars(patcher.clone()).items():
        if name not in _TIED_TO_THE_MODEL:
            setattr(rebased, name, value)
    return rebased


def _private_copy(model, plan: PrecisionPlan):
    base = model.model
    if getattr(base.model_config, "scaled_fp8", None) is not None:
        raise UserError(
            "weight_dtype: this model stores scaled fp8 weights, and converting them would drop the scales; "
            "keep weight_dtype at default (compute_dtype still works)"
        )
    _unload_everywhere(base)
    patcher = getattr(base, "current_patcher", None)
    copied = converted_copy(
        base,
        plan.weight_dtype,
        part=base.diffusion_model,
        channels_last=plan.channels_last,
        memo={id(patcher): None} if patcher is not None else None,
    )
    copied.diffusion_model.dtype = plan.weight_dtype
    manual_cast = plan.compute_dtype if plan.upcasts else None
    copied.manual_cast_dtype = manual_cast
    rebased = _rebased(model, copied)
    rebased.set_model_compute_dtype(manual_cast)
    return rebased


def _channels_last_input(executor, x, *args, **kwargs):
    if x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return executor(x, *args, **kwargs)


def _tf32_sampling(executor, *args, **kwargs):
    with tf32_scope():
        return executor(*args, **kwargs)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class SDOptPrecision:
    DESCRIPTION = (
        "Weight storage dtype, compute dtype, TF32 and channels-last for the diffusion model, on a copy: "
        "the input model is never changed. weight_dtype other than the model's makes a private copy of the "
        "UNet weights in that dtype (fp8 is stored, and upcast per layer to the compute dtype); the report "
        "shows the memory it saves. compute_dtype default: a new fp16/bf16/fp32 weight dtype is also computed "
        "in, otherwise the model keeps computing as it does. tf32 allows TF32 matmuls/convolutions (CUDA) "
        "during sampling only. channels_last stores conv weights channels-last in the private copy; without "
        "one, only the activations are made channels-last (the shared weights are converted per call)."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "weight_dtype": ([DEFAULT, *WEIGHT_DTYPES], {"default": DEFAULT}),
                "compute_dtype": ([DEFAULT, *COMPUTE_DTYPES], {"default": DEFAULT}),
                "tf32": ("BOOLEAN", {"default": False}),
                "channels_last": ("BOOLEAN", {"default": False}),
            }
        }

    def patch(self, model, weight_dtype, compute_dtype, tf32, channels_last):
        config = PrecisionConfig(
            weight_dtype=None if weight_dtype == DEFAULT else weight_dtype,
            compute_dtype=None if compute_dtype == DEFAULT else compute_dtype,
            tf32=tf32,
            channels_last=channels_last,
        )
        stored = model.model_dtype()
        computing = model.get_model_object("manual_cast_dtype") or stored
        plan = plan_precision(config, stored, computing, model.load_device)
        new_weights = plan.weight_dtype != stored
        if (new_weights or plan.compute_dtype != computing) and not hasattr(model, "set_model_compute_dtype"):
            raise UserError(
                f"{'weight_dtype' if new_weights else 'compute_dtype'}: this ComfyUI has no "
                "ModelPatcher.set_model_compute_dtype (added in early 2025); update ComfyUI"
            )

        if new_weights:
            m = _private_copy(model, plan)
        else:
            m = model.clone()
            if plan.compute_dtype != computing:
                m.set_model_compute_dtype(plan.compute_dtype)
            if channels_last:
                m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY, _channels_last_input)
        if tf32:
            m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _tf32_sampling)

        self._record(m, model, plan, config, stored, new_weights)
        return (m,)

    @staticmethod
    def _record(m, model, plan: PrecisionPlan, config: PrecisionConfig, stored: torch.dtype, new_weights: bool) -> None:
        options = m.model_options
        weight, compute = dtype_name(plan.weight_dtype), dtype_name(plan.compute_dtype)
        slow_half = (
            "fp16 runs slowly on most CPUs (44x slower than fp32 in docs/benchmarks.md); bf16 is the fast half type there"
            if plan.compute_dtype == torch.float16 and torch.device(m.load_device).type == "cpu"
            else ""
        )
        if config.weight_dtype:
            if new_weights:
                unet = model.model.diffusion_model
                before, after = weight_bytes(unet), weight_bytes(unet, plan.weight_dtype)
                change = f"saves {_mib(before - after)}" if after <= before else f"adds {_mib(after - before)}"
                note = "; ".join(
                    filter(
                        None,
                        [
                            f"{change} of UNet weights ({_mib(before)} → {_mib(after)})",
                            "a private copy, the input model is unchanged",
                            "" if config.compute_dtype else slow_half,
                        ],
                    )
                )
                add_optimization_record(options, NODE, f"weight={config.weight_dtype}", f"weight={weight} (compute {compute})", note)
            else:
                add_optimization_record(
                    options, NODE, f"weight={config.weight_dtype}", f"weight={weight} (unchanged)",
                    f"the model already stores its weights in {dtype_name(stored)}",
                )
        if config.compute_dtype:
            active = f"compute={compute}" + (f" (weights cast from {weight} per layer)" if plan.upcasts else "")
            add_optimization_record(options, NODE, f"compute={config.compute_dtype}", active, slow_half)
        if plan.tf32:
            device = torch.device(m.load_device)
            note = "" if device.type == "cuda" else f"no effect on {device.type}: TF32 is a CUDA matmul/cuDNN setting"
            add_optimization_record(options, NODE, "tf32", "tf32 during sampling", note)
        if plan.channels_last:
            if new_weights:
                add_optimization_record(options, NODE, "channels_last", "channels_last (weights and activations)")
            else:
                add_optimization_record(
                    options, NODE, "channels_last", "channels_last (activations)",
                    "conv weights stay NCHW in the shared model and are converted per call; "
                    "a weight_dtype change stores them channels-last",
                )


def _vae_in_dtype(vae, dtype: torch.dtype):
    """A copy of ``vae`` with its own weights in ``dtype`` and its own patcher."""
    _unload_everywhere(vae.first_stage_model)
    duplicate = copy_vae(vae)
    duplicate.first_stage_model = converted_copy(vae.first_stage_model, dtype)
    duplicate.patcher = _rebased(vae.patcher, duplicate.first_stage_model)
    duplicate.vae_dtype = dtype
    return duplicate


class _GuardReport:
    """Counts the executing prompt's decodes/encodes that had NaN/Inf and files them in its report."""

    def __init__(self, requested: str):
        self.requested = requested
        self.prompt_id = None
        self.counts = Counter()

    def __call__(self, vae, method: str, result: GuardedRun) -> None:
        prompt_id = current_prompt_id()
        if prompt_id != self.prompt_id:
            self.prompt_id, self.counts = prompt_id, Counter()
        outcome = f"redid {{}} in {dtype_name(result.redone_in[-1])}" if result.redone else "could not redo {} (nothing safer)"
        self.counts[(outcome, method.split("_")[0])] += 1
        done = "; ".join(
            outcome.format(f"{n} {op}{'s' if n > 1 else ''}") for (outcome, op), n in sorted(self.counts.items())
        )
        note_prompt_optimization(
            VAE_NODE, self.requested, f"{dtype_name(vae.vae_dtype)} (NaN guard {done})", f"last {method}: {result.describe()}"
        )


def _guarded(method: str, inner, safe_vae, report: _GuardReport):
    def guarded(self, *args, **kwargs):
        result = run_with_nan_guard(
            lambda: inner(self, *args, **kwargs),
            lambda dtype: getattr(safe_vae(dtype), method)(*args, **kwargs),
            self.vae_dtype,
            self.device,
        )
        if result.redone or not result.finite:
            report(self, method, result)
        return result.output

    return guarded


def _with_nan_guard(vae, source, requested: str):
    """A copy of ``vae`` whose decode/encode (tiled too) redo a NaN/Inf result in a safer dtype,
    with weights converted from ``source`` (the node's input) into a cached VAE per dtype."""
    safe_vaes = {}

    def safe_vae(dtype: torch.dtype):
        if dtype not in safe_vaes:
            safe_vaes[dtype] = source if source.vae_dtype == dtype else _vae_in_dtype(source, dtype)
        return safe_vaes[dtype]

    report = _GuardReport(requested)
    guarded = wrap_vae_methods(vae, lambda method, inner: _guarded(method, inner, safe_vae, report))
    guarded.sdopt_safe_vaes = safe_vaes
    return guarded


class SDOptVAEPrecision:
    DESCRIPTION = (
        "VAE dtype and NaN guard, on a copy: the input VAE is never changed. dtype other than the VAE's "
        "makes a copy of the VAE weights in that dtype. nan_guard redoes any decode/encode whose output has "
        "NaN/Inf (the fp16 black-image problem) in bf16 where the device runs it, else fp32, and the profile "
        "report counts the redone calls."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE",),
                "dtype": ([DEFAULT, *COMPUTE_DTYPES], {"default": DEFAULT}),
                "nan_guard": ("BOOLEAN", {"default": True}),
            }
        }

    def apply(self, vae, dtype, nan_guard):
        if getattr(vae, "first_stage_model", None) is None:
            raise UserError("vae: this VAE has no weights (the checkpoint holds no VAE); load one with a VAE loader")
        requested = f"dtype={dtype}, nan_guard={'on' if nan_guard else 'off'}"
        target = vae.vae_dtype if dtype == DEFAULT else parse_dtype(dtype, "dtype", COMPUTE_DTYPES)
        check_compute_dtype(target, vae.device, "dtype")

        out = vae if target == vae.vae_dtype else _vae_in_dtype(vae, target)
        active, notes = dtype_name(target), []
        if out is not vae:
            before, after = weight_bytes(vae.first_stage_model), weight_bytes(out.first_stage_model)
            notes.append(f"VAE weights {_mib(before)} → {_mib(after)}; a copy, the input VAE is unchanged")
        if nan_guard:
            safer = safe_dtype(target, vae.device)
            if safer is None:
                notes.append("the NaN guard can only report NaN/Inf: nothing is safer than fp32")
            else:
                active += f" (NaN guard redoes NaN/Inf in {dtype_name(safer)})"
            out = _with_nan_guard(out, vae, requested)
        note_prompt_optimization(VAE_NODE, requested, active, "; ".join(notes))
        return (out,)
