"""SDOptPrecision (MODEL → MODEL): weight and compute dtype, TF32 and channels-last, on a copy.

A compute-dtype change is ComfyUI's own ``set_model_compute_dtype`` on a clone. A weight-dtype or
layout change gets a private copy of the diffusion model's weights (``private_copy.private_copy``), converted
from the weights before any sdopt copy, so a second Precision node rounds as if it were alone; fp8
storage is upcast per layer by ComfyUI's cast path, or, with compute_dtype fp8_matmul, each Linear of
the copy multiplies in fp8 (``optim.precision.fp8_linear``) where its weight sits ready on the
input's device with no ComfyUI weight function pending, and otherwise runs ComfyUI's own forward.
Channels-last converts the 4-D (conv) weights:
with NCHW weights a channels-last activation would make every convolution convert its weight on
each call. TF32 is process-wide, so it is scoped to each sampling run by an OUTER_SAMPLE wrapper.
"""
import functools

import torch

from ..optim.precision import (AUTO, COMPUTE_DTYPES, FP8_MATMUL, WEIGHT_DTYPES, PrecisionConfig, converted_copy, dtype_name, fp8_linear,
                               fp8_linear_fits, fp8_matmul_kernel, pick_dtype, plan_precision, tf32_scope, weight_bytes)
from ..measure.profiler import format_mib
from . import environment, patching, private_copy
from .base import PatchNode
from .inputs import DEFAULT


NODE = "SDOptPrecision"


def _fp8_forward(module: torch.nn.Module, compute_dtype: torch.dtype, x: torch.Tensor, *args, **kwargs):
    plain = type(module).forward
    if args or kwargs or getattr(module, "weight_function", None) or getattr(module, "bias_function", None) \
            or module.weight.device != x.device:
        return plain(module, x, *args, **kwargs)
    return fp8_linear(x, module.weight, module.bias, compute_dtype).to(x.dtype)


def _multiply_in_fp8(diffusion_model: torch.nn.Module, compute_dtype: torch.dtype) -> tuple[int, int]:
    """Point every fp8 e4m3 Linear of ``diffusion_model`` (a private copy) whose widths ``fp8_linear``
    takes at it: (those layers, fp8 e4m3 Linear layers in all)."""
    linears = [m for m in diffusion_model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn]
    fitting = [m for m in linears if fp8_linear_fits(m.in_features, m.out_features)]
    for module in fitting:
        module.forward = functools.partial(_fp8_forward, module, compute_dtype)
    return len(fitting), len(linears)


def _tf32_sampling(executor, *args, **kwargs):
    with tf32_scope():
        return executor(*args, **kwargs)


class SDOptPrecision(PatchNode):
    DESCRIPTION = (
        "Sets the diffusion model's weight and compute dtypes, TF32 and channels-last convolutions, on a copy. "
        "auto picks what this device runs fast and accurately; the report says what it picked and why."
    )

    @classmethod
    def inputs(cls):
        return {
            "weight_dtype": ([AUTO, DEFAULT, *WEIGHT_DTYPES], {"default": AUTO, "tooltip": (
                "How the weights are stored. auto: fp16 on CUDA (bf16 where the model prefers it), on a CPU bf16 "
                "where faster, else fp32.")}),
            "compute_dtype": ([DEFAULT, *COMPUTE_DTYPES, FP8_MATMUL], {"default": DEFAULT, "tooltip": (
                "The dtype the model computes in. default: the weight dtype where the device computes in it. fp8_matmul: "
                "fp8 Linear layers (fp8_e4m3fn weights, compute capability 8.9+).")}),
            "tf32": ("BOOLEAN", {"default": False, "tooltip": "Allow TF32 matmuls and convolutions (CUDA, Ampere and newer) during sampling only."}),
            "channels_last": ("BOOLEAN", {"default": False, "tooltip": (
                "Store the conv weights channels-last in a private copy: faster convolutions on tensor-core GPUs, "
                "above all under sdopt Compile. Costs a copy in RAM.")}),
        }

    def patch(self, model, weight_dtype, compute_dtype, tf32, channels_last):
        device = torch.device(model.load_device)
        notes = []
        stored = model.model_dtype()
        compute = None if compute_dtype == DEFAULT else compute_dtype
        if weight_dtype == AUTO and private_copy.is_quantized(model):
            weight = None
            notes.append("auto: weights kept as loaded: they are quantized, which ComfyUI runs natively, "
                         "and a converted copy would drop their scales")
        elif weight_dtype == AUTO:
            pick = pick_dtype(device, environment.inference_dtypes(model))
            picked, loaded = dtype_name(pick.dtype), private_copy.loaded_weight_dtype(model)
            weight = picked
            if loaded.itemsize < pick.dtype.itemsize:
                # Weights loaded narrower than the pick (fp8) were ComfyUI's or the user's choice for memory.
                weight, compute = dtype_name(loaded), compute or picked
                notes.append(f"auto: weights kept in {weight} as loaded, since a {picked} copy would take "
                             f"{pick.dtype.itemsize // loaded.itemsize}x their memory (set weight_dtype to {picked} "
                             f"to trade that memory for speed); computing in {compute}")
            notes.append(f"auto: {pick.reason}")
        else:
            weight = None if weight_dtype == DEFAULT else weight_dtype
        config = PrecisionConfig(weight, compute, tf32, channels_last)
        convs = sum(p.ndim == 4 for p in model.model.diffusion_model.parameters())
        computing = model.get_model_object("manual_cast_dtype") or stored
        plan = plan_precision(config, stored, computing, device)
        if plan.weight_dtype != stored or channels_last or plan.fp8_matmul:
            private_copy.refuse_quantized(model, *(("weight_dtype", "set it to auto or default (as loaded)") if plan.weight_dtype != stored else
                                           ("compute_dtype", "pick another compute dtype") if plan.fp8_matmul else
                                           ("channels_last", "turn it off")))
            unet = model.model.diffusion_model
            m = private_copy.private_copy(model, lambda module: converted_copy(module, plan.weight_dtype, channels_last, private_copy.DYNAMIC_VRAM_LAYER_STATE), notes)
            m.model.diffusion_model.dtype = plan.weight_dtype
            m.model.manual_cast_dtype = plan.compute_dtype if plan.upcasts else None
            m.set_model_compute_dtype(m.model.manual_cast_dtype)
            if plan.fp8_matmul:
                fitting, linears = _multiply_in_fp8(m.model.diffusion_model, plan.compute_dtype)
                notes.append(f"fp8 matmuls: {fitting} of {linears} Linear layers through {fp8_matmul_kernel(device)}, activations scaled "
                             f"to e4m3 per call" + (f"; the other {linears - fitting} (widths not multiples of 16) and "
                                                     "every other op compute" if fitting < linears else "; every other op computes")
                             + f" in {dtype_name(plan.compute_dtype)}")
            before, after = weight_bytes(unet), weight_bytes(unet, plan.weight_dtype)
            layout = f", {convs} conv weights channels-last," if channels_last else ""
            notes.append(f"diffusion model weights {format_mib(before)} → {format_mib(after)} MiB{layout} in a private copy; "
                         "the input model is unchanged")
        else:
            m = model.clone()
            if plan.compute_dtype != computing:
                m.set_model_compute_dtype(plan.compute_dtype)
        patching.set_wrappers(m, NODE, {"OUTER_SAMPLE": _tf32_sampling} if tf32 else {})
        shorts = []
        if tf32 and device.type != "cuda":
            shorts.append(f"tf32 has no effect on {device.type}")
            notes.append(f"{shorts[-1]}: it is a CUDA setting")
        if channels_last and convs < 2:
            shorts.append("channels_last: almost no convolutions to lay out")
            notes.append("channels_last changes little here: this diffusion model has almost no convolutions "
                         "(a diffusion transformer's only conv, if any, is its patch embedding)")
        short = "; ".join(shorts)
        requested = f"weight={weight_dtype}, compute={compute_dtype}, tf32={'on' if tf32 else 'off'}, channels_last={'on' if channels_last else 'off'}"
        compute = f"{FP8_MATMUL}+{dtype_name(plan.compute_dtype)}" if plan.fp8_matmul else dtype_name(plan.compute_dtype)
        active = f"weight={dtype_name(plan.weight_dtype)}, compute={compute}" + (", tf32" if tf32 else "") + (", channels_last" if channels_last else "")
        patching.record_model(m, NODE, requested, active, "; ".join(notes), short)
        return (m,)
