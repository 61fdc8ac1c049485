"""SDOptOffload (MODEL → MODEL): how many of this model's weights stay in VRAM while it samples.

Works through ComfyUI's model management, not around it. A PREPARE_SAMPLING wrapper lets ComfyUI
load the model as usual, asks ``optim.offload.plan_residency`` what this model may keep, then frees
the rest with the patcher's own ``partially_unload`` (ComfyUI then casts those layers to the GPU as
they run, on its async offload streams, so one layer's copy overlaps the previous layer's compute),
or loads the rest with ``partially_load``. ``unload_after`` frees the weights as the sampler returns
(a SAMPLER_SAMPLE wrapper, inside any profiler's run), the way ComfyUI's memory manager unloads a model.

ComfyUI 0.38's dynamic VRAM streams every model under one global policy; ``none``, ``budget`` and
``sequential`` run on the patcher's non-dynamic delegate (as ComfyUI's TorchCompileModel does), so
this model's budget holds. The record says which path ran.
"""
from ..optim.offload import MIB, MODES, OffloadConfig, plan_residency, residency_summary, unavailable
from . import environment, patching
from .base import PatchNode
from .inputs import on_unavailable_input

NODE = "SDOptOffload"


def _model_management():
    import comfy.model_management

    return comfy.model_management


def _streaming_note() -> str:
    streams = getattr(_model_management(), "NUM_STREAMS", None)
    if streams is None:
        return ""
    if streams:
        return f"streamed layers are copied on ComfyUI's {streams} async offload streams, ahead of their compute"
    return "ComfyUI's async offload is off (--disable-async-offload): each streamed layer is copied just before it runs"


def _pinned_note(model) -> str:
    """How much of ``model``'s streamed weights ComfyUI keeps in pinned (page-locked) host memory, where
    its patcher says (``pinned``, ComfyUI 0.3.6x on): only copies from pinned memory overlap compute."""
    keys = getattr(model, "pinned", None)
    if keys is None:
        return ""
    sizes = {name: p.numel() * p.element_size() for name, p in model.model.named_parameters()}
    pinned = sum(sizes.get(key, 0) for key in keys)
    if not pinned:
        return ("none of the streamed weights is in pinned host memory (ComfyUI's --disable-pinned-memory, or its "
                "pinned-memory limit): copies from pageable RAM do not overlap compute")
    return f"{pinned / MIB:,.1f} MiB of the streamed weights in ComfyUI's pinned host memory"


def _unload(model) -> int:
    """Free ``model``'s weights from the device through ComfyUI's loaded-model list; the bytes freed."""
    mm = _model_management()
    for i, loaded in enumerate(mm.current_loaded_models):
        if loaded.model is not None and loaded.model.is_clone(model):
            freed = loaded.model.loaded_size()
            mm.current_loaded_models.pop(i).model_unload()
            mm.soft_empty_cache()
            return freed
    return 0


def offload_wrappers(config: OffloadConfig, requested: str, path_note: str) -> dict:
    """The wrappers that hold a sampled model to ``config`` (for a model on a GPU)."""

    def prepare_sampling(executor, model, *args, **kwargs):
        if config.mode == "none" and "force_full_load" in kwargs:  # ComfyUI 0.38
            kwargs["force_full_load"] = True
        prepared = executor(model, *args, **kwargs)
        residency = plan_residency(config, model.model_size(), model.loaded_size())
        if residency.bytes_to_free:
            model.partially_unload(model.offload_device, residency.bytes_to_free)
        elif residency.bytes_to_load:
            model.partially_load(model.load_device, residency.bytes_to_load)
        streamed = model.loaded_size() < model.model_size()
        note = "; ".join(filter(None, [path_note, *((_streaming_note(), _pinned_note(model)) if streamed else ())]))
        patching.record_in_run(NODE, requested, f"{config.describe()}: {residency_summary(model.loaded_size(), model.model_size())}", note)
        return prepared

    def unload_after_sampling(executor, guider, *args, **kwargs):
        try:
            return executor(guider, *args, **kwargs)
        finally:
            freed = _unload(guider.model_patcher)
            patching.record_in_run(NODE, requested, f"unload_after: {freed / MIB:,.1f} MiB of weights freed from the device after sampling", path_note)

    if config.mode == "unload_after":
        return {"SAMPLER_SAMPLE": unload_after_sampling}
    return {"PREPARE_SAMPLING": prepare_sampling}


def offload_clone(model, config: OffloadConfig, requested: str, on_unavailable: str):
    """A clone of ``model`` held to ``config`` whenever it samples; where ComfyUI's dynamic VRAM streams
    the model and has no non-dynamic copy of it, ``on_unavailable`` decides, and the fallback leaves
    the streaming to ComfyUI."""
    if config.mode == "unload_after":
        return _held(model.clone(), config, requested, "")
    m, path_note, problem = environment.non_dynamic_clone(model)
    reason = patching.fall_back_or_raise(on_unavailable, problem, "leave the streaming to ComfyUI")
    if reason:
        return _passed_through(model, requested, f"{reason}; ComfyUI's dynamic VRAM streams it", f"does nothing: {reason}")
    return _held(m, config, requested, path_note)


def _held(m, config: OffloadConfig, requested: str, path_note: str):
    patching.set_wrappers(m, NODE, offload_wrappers(config, requested, path_note))
    patching.record_model(m, NODE, requested, config.describe(), path_note)
    return m


def _passed_through(model, requested: str, note: str, short: str):
    """A clone of ``model`` without this node's wrappers, recorded as doing nothing."""
    m = patching.patched_clone(model, NODE)
    patching.record_model(m, NODE, requested, "no-op", note, short)
    return m


class SDOptOffload(PatchNode):
    DESCRIPTION = (
        "Chooses how many of this model's weights stay in VRAM while it samples: none keeps all, budget at most "
        "budget_mb (the rest streamed layer by layer), sequential streams every layer, unload_after frees them afterwards."
    )

    @classmethod
    def inputs(cls):
        return {
            "mode": (list(MODES), {"default": "budget", "tooltip": "none: all weights resident; budget: at most budget_mb resident; sequential: stream every layer; unload_after: free VRAM when sampling ends."}),
            "budget_mb": ("INT", {"default": 1024, "min": 0, "max": 1 << 20, "tooltip": "budget mode: MiB of this model's weights that may stay in VRAM."}),
            "on_unavailable": on_unavailable_input("On a CPU, or under dynamic VRAM without a non-dynamic copy: fallback leaves the model as it is with a note, error stops."),
        }

    def patch(self, model, mode, budget_mb, on_unavailable):
        config = OffloadConfig(mode, budget_mb * MIB)
        requested = f"mode={mode}" + (f", budget_mb={budget_mb}" if mode == "budget" else "")
        problem = unavailable(config, model.load_device)
        if problem is None:
            return (offload_clone(model, config, requested, on_unavailable),)
        # mode none asks for nothing, so it cannot fail
        reason = patching.fall_back_or_raise(on_unavailable if mode != "none" else "fallback", problem, "pass the model through")
        return (_passed_through(model, requested, reason, f"does nothing: {reason}" if mode != "none" else ""),)
