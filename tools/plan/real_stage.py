"""The child side of ``plan --check``: one stage of a model run for real (random weights, stock settings)
in this fresh process, and what it grew the process's memory by (``check`` starts the process).

``measure_stage`` runs the same stage for real (random weights) in a fresh process and returns the
growth of its peak RSS: VmHWM after the stage minus the RSS before it, the high-water mark reset
through /proc/self/clear_refs once the model is built and the stage has run once at 64 px (text
encode, which does not grow with the image, on an 8-token prompt). So the
baseline holds the interpreter, the libraries, the weights, the inputs and what the first call of a
library sets up once (oneDNN primitives, OpenMP threads, MKL buffers: 60-120 MiB, which `bench vae`
leaves in its baseline too): the measured figure is what the planner predicts, the stage's working
memory. glibc's heap reuse makes that figure vary by about 15% from one fresh process to the next,
so ``check_predictions`` (``python -m sdopt plan --check``) takes the median of several. With
``--workspace cuda`` the check builds and runs the stage on the GPU in the planned dtype and measures
what torch's allocator hands out at the stage's peak beyond what it held before (``max_memory_allocated``
after a reset): the figure a VRAM budget is about, exact from one run to the next. It runs the stage
under a cap of the prediction plus ``PLANNER_TOLERANCE`` (PyTorch's memory fraction): cuDNN's
convolutions take workspace from whatever is free (PyTorch's cuDNN path allocates a plan's workspace
and, when that runs out of memory, moves to a plan that needs less, or halves the request), so an
uncapped peak says how much was free more than what the stage needs; on the H200 the SD1.5 VAE decode at 1024² peaked 37% above its prediction uncapped. A stage
that does not run within the cap is an under-prediction and fails the check.
"""
from __future__ import annotations

import torch

from ...measure.profiler import allocated_growth, peak_rss_growth
from ...optim.heap_trim import trim_heap
from ...optim.precision import DTYPES
from ..fresh_process import serve_child
from ...measure.memory_model import LiveBytesMode
from .models import build_modules
from .settings import STAGE_MODEL
from .stages import stage_call

_WARM_UP_SIZE = 64
# Text encode does not grow with the image: warmed up at the full prompt, its own tensors would be in
# the baseline, so the warm-up encodes a short prompt.
_WARM_UP_TOKENS = 8


def _allocated_growth(fn, device: torch.device, cap_bytes: int | None = None) -> int | None:
    """Bytes ``fn()`` adds at its peak to what torch's CUDA allocator had handed out before it; with
    ``cap_bytes``, PyTorch may reserve only that much more than it holds now, and None means
    ``fn`` ran out of memory within it."""
    torch.cuda.empty_cache()
    if cap_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        index = device.index if device.index is not None else torch.cuda.current_device()  # it takes no bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(device) + cap_bytes) / total), index)
    try:
        return allocated_growth(device, fn)[1]
    except torch.OutOfMemoryError:
        return None


def _measure_here(spec: dict) -> dict:
    """One real stage (random weights, stock settings) in this process: on a CPU the growth of peak
    RSS while it runs, on a GPU the growth of torch's peak allocated memory."""
    torch.manual_seed(0)
    # The VAE's config gives the latent shape to every stage; nothing else is built that the stage does not run.
    model, device, dtype = spec["model"], torch.device(spec.get("device", "cpu")), DTYPES[spec.get("dtype", "fp32")]
    modules = {name: m.to(dtype) for name, m in build_modules(model, device, tuple({STAGE_MODEL[spec["stage"]], "vae"})).items()}
    if dtype != torch.float32:
        trim_heap()  # the fp32 weights the conversion freed would otherwise serve the stage unseen
    make = lambda shape, dtype: (torch.randn(shape, device=device, dtype=dtype) if dtype.is_floating_point
                                 else torch.zeros(shape, dtype=dtype, device=device))
    with torch.inference_mode():  # the libraries' one-time set-up belongs to the baseline
        warm_up, warm_up_inputs = stage_call(model, spec["stage"], modules, _WARM_UP_SIZE, _WARM_UP_SIZE, dtype, make,
                                             prompt_tokens=_WARM_UP_TOKENS)
        warm_up(*warm_up_inputs)
    del warm_up, warm_up_inputs
    fn, inputs = stage_call(model, spec["stage"], modules, spec["width"], spec["height"], dtype, make)
    with torch.inference_mode():
        if device.type == "cuda":
            measured = _allocated_growth(lambda: fn(*inputs), device, spec.get("cap_bytes"))
            if measured is None:
                return {"measured_bytes": None}
            # The same run's tensors counted as the planner counts them, on the GPU's own op sequence:
            # where this agrees with the prediction and the allocator does not, the difference is
            # the kernels' own allocations; where it disagrees, the ops are.
            with LiveBytesMode("none") as tensors:
                fn(*inputs)
            return {"measured_bytes": measured, "tensor_peak_bytes": tensors.peak_bytes, "tensor_peak_op": tensors.peak_op}
        # The high-water mark of building the models and warming up is not the stage's: it is reset.
        _, _, growth = peak_rss_growth(lambda: fn(*inputs))
    return {"measured_bytes": growth}


if __name__ == "__main__":
    serve_child(_measure_here)
