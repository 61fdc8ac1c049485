"""SDOptAuto (MODEL, optional VAE → MODEL, VAE): the fastest stack of sdopt's own nodes that fits this
machine and this image, chosen at each sampling run once the latent's size is known.

The node returns a clone with one OUTER_SAMPLE wrapper (and the VAE through Tiled VAE, which tiles only
when an untiled decode would not fit). At a sampling run the wrapper, innermost of the OUTER_SAMPLE
wrappers already there (so a Profiler around it sees the run), gathers what the device offers (Compile's
and CUDA Graph's own availability checks), what the model is (its weights, its convolutions, the Step
Cache mode that fits it), predicts each candidate's step on fake tensors (``step_prediction``) and
takes the stack ``stack_choice`` picks. It builds that stack by calling the single nodes on the model
the sampler was given, then hands the sampler that copy for this run only, with the OUTER_SAMPLE
wrappers the stack added. A run at the same latent shape reuses the stack built for it (its compiled
code and graphs with it); a new shape decides again and the record says so. A model call's working
peak, as allocated, is measured beside the prediction (on a CPU the heap keeps more resident: that
figure is predicted for the budget, and shown, but what the profiler reads is what the two are held to).
"""
from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from ..errors import UserError
from ..measure.profiler import active_run, allocated_growth, outside_any_run
from ..optim.compile import CompileConfig
from ..optim.compile import unavailable as compile_unavailable
from ..optim.cuda_graph import GraphConfig
from ..optim.cuda_graph import unavailable as graph_unavailable
from . import environment, patching
from .attention import SDOptAttention
from .base import SDOptNode
from .compile import NCHW_NOTE_MIN_BYTES, SDOptCompile
from .cuda_graph import SDOptCUDAGraph
from .inputs import patched_input
from .lowmem import SDOptLowMemory
from .offload import SDOptOffload
from .precision import SDOptPrecision
from .stack_choice import GOALS, MIB, SDPA_ATTENTION, DeviceFacts, NodeStep, Stack, StepPrediction, choose_stack
from .step_cache import SDOptStepCache, block_groups
from .step_prediction import call_batch, predict_step, step_conds
from .tiled_vae import SDOptTiledVAE

NODE = "SDOptAuto"
MEASURE_KEY = "SDOptAuto.measure"
NODE_CLASSES = {cls.__name__: cls for cls in (SDOptPrecision, SDOptAttention, SDOptCompile, SDOptCUDAGraph, SDOptStepCache,
                                              SDOptLowMemory, SDOptOffload)}
# Stacks kept per Auto output (each may hold compiled code, graphs or a converted copy of the weights).
KEEP_STACKS = 4
# The model calls whose working peak is read (0-based): the first runs eager before a compile, the second
# may compile; reading every call would run every call under the profiler on a CPU.
MEASURED_CALLS = frozenset({2, 4, 8, 16, 32, 64})
# What the prediction runs for a stack: its memory-relevant nodes only (Compile routes attention through
# sdopt's sdpa where ComfyUI's would break its graph, so a compiled stack is predicted with sdpa).
PREDICTED_NODES = ("SDOptAttention", "SDOptLowMemory")


def build_stack(model, stack: Stack):
    """``model`` through ``stack``'s single nodes in order."""
    for step in stack.steps:
        cls = NODE_CLASSES[step.node]
        model = getattr(cls(), cls.FUNCTION)(model, **step.values())[0]
    return model


def device_facts(model, budget_mb: int) -> DeviceFacts:
    """What ``stack_choice`` needs of this device and model: the nodes' own availability checks, the
    model's convolutions and block groups, its weights and the memory the run may use."""
    device = torch.device(model.load_device)
    compile_problem = compile_unavailable(CompileConfig(), device)
    graph_problem = graph_unavailable(GraphConfig(), device)
    unet = model.get_model_object("diffusion_model")
    convs = sum(m.weight.numel() * m.weight.element_size() for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    return DeviceFacts(
        cuda=device.type == "cuda",
        compile_problem=compile_problem.reason if compile_problem else None,
        graph_problem=graph_problem.reason if graph_problem else None,
        has_convs=convs >= NCHW_NOTE_MIN_BYTES,
        cache_mode="first_block" if block_groups(model) else "deepcache",
        weights_bytes=int(model.model_size()),
        budget_bytes=budget_mb * MIB if budget_mb else _free_for_the_run(model, device),
    )


def _free_for_the_run(model, device: torch.device) -> int:
    """What ComfyUI could give this run on ``device``: free memory, plus on a GPU what its loaded models
    hold (it unloads them for the next one as needed)."""
    free = environment.free_for_work(device, model)
    if device.type != "cuda":
        return free
    from comfy import model_management

    loaded = sum(getattr(m.model, "loaded_size", lambda: 0)() for m in model_management.current_loaded_models
                 if getattr(m, "device", device) == device and m.model is not None)
    return free + loaded


class AutoStack:
    """One decision: the stack built for a latent shape (its key in ``AutoState.stacks``), its choice, and the working peak read."""

    def __init__(self, source, patcher, choice, predicted: StepPrediction | None):
        self.source, self.patcher, self.choice = source, patcher, choice
        self.predicted = predicted
        self.calls, self.measured_allocated = 0, None


class AutoState:
    """What one Auto output keeps across runs: its settings and the stacks it built, newest last."""

    def __init__(self, goal: str, allow_approximate: bool, budget_mb: int):
        self.goal, self.allow_approximate, self.budget_mb = goal, allow_approximate, budget_mb
        self.stacks: OrderedDict[tuple, AutoStack] = OrderedDict()
        self.last_shape: tuple | None = None

    def requested(self) -> str:
        return f"goal={self.goal}, allow_approximate={self.allow_approximate}, vram_budget_mb={self.budget_mb}"

    def stack_for(self, guider, noise_shape: torch.Size) -> tuple[AutoStack, str]:
        """The stack for a run of ``guider`` at ``noise_shape`` and what the decision was: reused, first, or
        made again because the shape changed."""
        source = guider.model_patcher
        key = (id(source), tuple(noise_shape), float(guider.cfg))
        entry = self.stacks.get(key)
        if entry is not None and entry.source is source:
            self.stacks.move_to_end(key)
            return entry, f"reused the stack chosen for {_shape(noise_shape)}"
        how = (f"decided again for {_shape(noise_shape)} (the last run was {_shape(self.last_shape)})"
               if self.last_shape is not None and self.last_shape != tuple(noise_shape) else f"decided for {_shape(noise_shape)}")
        entry = self._decide(guider, source, noise_shape)
        self.stacks[key] = entry
        while len(self.stacks) > KEEP_STACKS:
            self.stacks.popitem(last=False)
        self.last_shape = tuple(noise_shape)
        return entry, how

    def _decide(self, guider, source, noise_shape: torch.Size) -> AutoStack:
        facts = device_facts(source, self.budget_mb)
        batch = call_batch(noise_shape, guider.cfg, guider.model_options)
        conds = step_conds(source.model, guider.conds.get("positive", []), noise_shape, batch)
        device = torch.device(source.load_device)

        @functools.cache
        def predict_steps(steps: tuple[NodeStep, ...]):
            try:
                return predict_step(build_stack(source, Stack("probe", steps)), conds, noise_shape, batch, device)
            except Exception:  # a model the fake tensors cannot trace: the choice runs without a prediction
                return None

        def predict(stack: Stack):
            steps = tuple(step for step in stack.steps if step.node in PREDICTED_NODES)
            if any(step.node == "SDOptCompile" for step in stack.steps) and not any(s.node == "SDOptAttention" for s in steps):
                steps = (SDPA_ATTENTION,) + steps
            return predict_steps(steps)

        with outside_any_run():  # the probes' Attention nodes report their calls into the active run
            choice = choose_stack(facts, self.goal, self.allow_approximate, predict)
            predicted = predict(choice.stack)
        patcher = build_stack(source, choice.stack)
        entry = AutoStack(source, patcher, choice, predicted)
        patching.set_wrappers(patcher, MEASURE_KEY, {"APPLY_MODEL": functools.partial(_measured_call, entry)})
        patching.make_outermost(patcher, MEASURE_KEY, "APPLY_MODEL")
        return entry


def _shape(shape) -> str:
    return "x".join(map(str, shape)) if shape else "?"


def _measured_call(entry: AutoStack, executor, *args, **kwargs):
    """A model call of the chosen stack, its working peak read on the calls ``MEASURED_CALLS`` names."""
    index, entry.calls = entry.calls, entry.calls + 1
    if index not in MEASURED_CALLS:
        return executor(*args, **kwargs)
    x = args[0] if args else kwargs["x"]
    out, entry.measured_allocated = allocated_growth(x.device, lambda: executor(*args, **kwargs))
    return out


def _run_stack(state: AutoState, guider, noise, *args, **kwargs):
    """The sampler's run on the stack chosen for ``noise``'s shape, the guider's own model restored after."""
    import comfy.model_patcher
    import comfy.patcher_extension
    import comfy.sampler_helpers

    entry, how = state.stack_for(guider, noise.shape)
    stack = entry.patcher
    options = comfy.model_patcher.create_model_options_clone(stack.model_options)
    comfy.sampler_helpers.prepare_model_patcher(stack, guider.conds, options)
    outer = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
    running = comfy.patcher_extension.get_all_wrappers(outer, guider.model_options, is_model_options=True)
    added = [fn for fn in comfy.patcher_extension.get_all_wrappers(outer, options, is_model_options=True)
             if not any(fn is other for other in running)]
    _file_stack_records(state, entry, how, guider.model_options)
    own = guider.model_patcher, guider.model_options
    guider.model_patcher, guider.model_options = stack, options
    try:
        output = comfy.patcher_extension.WrapperExecutor.new_class_executor(guider.outer_sample, guider, added).execute(
            noise, *args, **kwargs)
    finally:
        guider.model_patcher, guider.model_options = own
        stack.restore_hook_patches()
    _file_auto_record(state, entry, how)
    return output


def _file_stack_records(state: AutoState, entry: AutoStack, how: str, given_options: dict) -> None:
    """The chosen nodes' records into the profiled run (a Profiler outside Auto read the model it was given)."""
    if active_run() is None:
        return
    given = {r["node"] for r in patching.model_records(given_options)}
    for r in patching.model_records(entry.patcher.model_options):
        if r["node"] not in given:
            patching.record_in_run(r["node"], r["requested"], r["active"], r["note"], r["short"])
    _file_auto_record(state, entry, how)


def _file_auto_record(state: AutoState, entry: AutoStack, how: str) -> None:
    choice = entry.choice
    mib = lambda n: f"{n / MIB:,.0f} MiB"  # noqa: E731
    predicted, measured = "", ""
    if entry.predicted is not None:
        step = entry.predicted
        kept = "" if step.working_bytes == step.allocated_bytes else f", {mib(step.working_bytes)} resident"
        predicted = f"predicted step working peak {mib(step.allocated_bytes)} allocated{kept}" + (
            f", need {mib(choice.need_bytes)}" if choice.need_bytes is not None else "")
        if entry.measured_allocated is not None and step.allocated_bytes:
            error = entry.measured_allocated / step.allocated_bytes - 1
            measured = f"measured {mib(entry.measured_allocated)} allocated ({error:+.0%} against the prediction)"
    ruled = "; ".join(f"ruled out {name}" + (f" (predicted {mib(need)})" if need is not None else "") + f": {why}"
                      for name, need, why in choice.ruled_out)
    note = "; ".join(filter(None, [how, *choice.reasons, predicted, measured, ruled]))
    short = "" if choice.stack.exact else "approximate: Step Cache changes the image"
    patching.record_in_run(NODE, state.requested(), f"{choice.stack.name}: {choice.stack.describe()}", note, short)


def _outer_sample(state: AutoState):
    def outer_sample(executor, *args, **kwargs):
        if not (hasattr(executor, "wrappers") and hasattr(executor, "idx")):
            raise UserError("sdopt Auto: this ComfyUI's wrapper executor does not list its wrappers (wrappers, idx); "
                            "wire the single sdopt nodes instead")
        guider = executor.class_obj
        import comfy.patcher_extension

        rest = executor.wrappers[executor.idx + 1:]
        run = functools.partial(_run_stack, state, guider)
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(run, guider, rest).execute(*args, **kwargs)

    outer_sample.auto_state = state  # what the benches and tests read back: the stacks this output built
    return outer_sample


def auto_state(model) -> AutoState | None:
    """The ``AutoState`` of the Auto output ``model`` is (or is a copy of), None for any other model."""
    kinds = patching.wrapper_types()
    wrappers = getattr(model, "wrappers", {}).get(kinds.OUTER_SAMPLE, {}).get(NODE, [])
    return next((getattr(fn, "auto_state") for fn in wrappers if hasattr(fn, "auto_state")), None)


class SDOptAuto(SDOptNode):
    DESCRIPTION = (
        "Picks and applies the fastest stack of sdopt nodes that fits this machine and this image, per sampling run, "
        "from the device, the model and the predicted memory of each stack. Exact unless allow_approximate adds Step Cache."
    )
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL", "VAE")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": patched_input("MODEL"),
                "goal": (list(GOALS), {"default": GOALS[0], "tooltip": (
                    "fastest: the fastest stack predicted to fit. balanced: the fastest with 20% to spare. "
                    "fit: the least memory, for the largest images.")}),
                "allow_approximate": ("BOOLEAN", {"default": False, "tooltip": (
                    "Also add Step Cache, which changes the image (fewer model calls).")}),
                "vram_budget_mb": ("INT", {"default": 0, "min": 0, "max": 1 << 20, "step": 64, "tooltip": (
                    "Memory the run may use, in MiB; 0: what ComfyUI says is free.")}),
            },
            "optional": {"vae": patched_input("VAE")},
        }

    def apply(self, model, goal, allow_approximate, vram_budget_mb, vae=None):
        state = AutoState(goal, allow_approximate, vram_budget_mb)
        m = patching.patched_clone(model, NODE, {"OUTER_SAMPLE": _outer_sample(state)})
        patching.record_model(m, NODE, state.requested(), "chooses its stack at each sampling run",
                              "the chosen stack and why are in the profiled run's record")
        if vae is not None:
            vae = SDOptTiledVAE().apply(vae, 0, 0, True, vram_budget_mb)[0]
        return (m, vae)
