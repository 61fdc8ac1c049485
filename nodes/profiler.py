"""SDOptProfiler (MODEL → MODEL): profile every sampling run of a model.

Keyed OUTER_SAMPLE and SAMPLER_SAMPLE wrappers on a clone: the outer one scopes peak memory around
load and sampling (plus the VRAM ComfyUI 0.38's dynamic VRAM maps past PyTorch's allocator, where
it is on) and files the finished run under the executing prompt; the inner one times the
sampler and marks every step through the sampler callback. Both take ComfyUI's arguments as given,
so new ones (``latent_shapes`` in 0.33) pass through. Each run names the model's family.
"""
from ..errors import UserError
from ..measure.profiler import SamplingRun, active_run
from . import environment, patching, prompt_context
from .base import PatchNode

NODE = "SDOptProfiler"


def _outer_sample(label: str):
    def outer_sample(executor, *args, **kwargs):
        guider = executor.class_obj
        prompt_id = prompt_context.current_prompt_id()
        prompt_context.install_node_timer(prompt_id, prompt_context.current_node_id())
        patcher = guider.model_patcher
        run = SamplingRun(label, patcher.load_device, patching.model_records(guider.model_options), environment.dynamic_vram_probe(patcher.load_device),
                          environment.model_family(patcher).label)
        with run.memory_scope():
            output = executor(*args, **kwargs)
        if run.finished:  # a guider that never calls the sampler wrapper leaves nothing to report
            prompt_context.prompt_log(prompt_id).runs.append(run.result().to_dict())
        return output

    return outer_sample


def _sampler_sample(executor, *args, **kwargs):
    run = active_run()
    if run is None:
        return executor(*args, **kwargs)
    arguments = dict(zip(("guider", "sigmas", "extra_args", "callback"), args))
    callback = arguments.get("callback", kwargs.get("callback"))

    def step_callback(*step_args):
        run.step()
        if callback is not None:
            callback(*step_args)

    if "callback" in arguments:
        args = (*args[:3], step_callback, *args[4:])
    else:
        kwargs["callback"] = step_callback
    run.start()
    output = executor(*args, **kwargs)
    run.finish()
    return output


class SDOptProfiler(PatchNode):
    DESCRIPTION = (
        "Measures every sampling run of this model: step times, steady it/s and peak memory, and what each sdopt "
        "node ran. Put it last on the MODEL path, with an sdopt Profile Report after the sampler."
    )
    FUNCTION = "apply"

    @classmethod
    def inputs(cls):
        return {"label": ("STRING", {"default": "baseline", "tooltip": "Names this model's runs in the report."})}

    def apply(self, model, label):
        label = label.strip()
        if not label:
            raise UserError("label: it is empty; give the runs a name, e.g. 'baseline'")
        prompt_context.install_node_timer(prompt_context.current_prompt_id(), prompt_context.current_node_id())
        return (patching.patched_clone(model, NODE, {"OUTER_SAMPLE": _outer_sample(label), "SAMPLER_SAMPLE": _sampler_sample}),)
