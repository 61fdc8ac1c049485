"""SDOptProfiler (MODEL → MODEL) and SDOptProfileReport (output node).

The profiler attaches keyed OUTER_SAMPLE and SAMPLER_SAMPLE wrappers to a clone: the
outer one scopes peak memory around load + sampling and files the finished run under
the executing prompt; the inner one times the sampler and marks every step through
the sampler callback. The report node gathers the prompt's runs, its optimization
records and per-node timings into one report: a table shown in the node (see
web/sdopt.js), a chart image, and a JSON file in the output folder.
"""
from __future__ import annotations

import os

import comfy.model_management
import comfy.patcher_extension
import folder_paths

from ..optim.profiler import SamplingRun, active_run
from ..optim.report import Report, device_name
from .node_timing import install_node_timer, node_timings
from .records import current_node_id, current_prompt_id, file_run, optimization_records, prompt_notes, prompt_runs

WRAPPER_KEY = "sdopt.profiler"


def _comfyui_version() -> str | None:
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return __version__


def _outer_sample_wrapper(label: str):
    def outer_sample(executor, *args, **kwargs):
        guider = executor.class_obj
        prompt_id = current_prompt_id()
        install_node_timer(prompt_id, current_node_id())
        run = SamplingRun(label, guider.model_patcher.load_device, optimization_records(guider.model_options))
        with run.memory_scope():
            output = executor(*args, **kwargs)
        file_run(run.result().to_dict(), prompt_id)
        return output

    return outer_sample


def _sampler_sample(executor, guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar):
    run = active_run()
    if run is None:
        return executor(guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)

    def step_callback(step, denoised, x, total_steps):
        run.step()
        if callback is not None:
            callback(step, denoised, x, total_steps)

    run.start()
    output = executor(guider, sigmas, extra_args, step_callback, noise, latent_image, denoise_mask, disable_pbar)
    run.finish()
    return output


def attach_profiler(model, label: str):
    """Profile every sampling run of ``model`` (a ModelPatcher clone) under ``label``."""
    outer, inner = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE
    model.remove_wrappers_with_key(outer, WRAPPER_KEY)
    model.remove_wrappers_with_key(inner, WRAPPER_KEY)
    model.add_wrapper_with_key(outer, WRAPPER_KEY, _outer_sample_wrapper(label))
    model.add_wrapper_with_key(inner, WRAPPER_KEY, _sampler_sample)
    return model


class SDOptProfiler:
    DESCRIPTION = (
        "Profiles every sampling run of this model: sampler total time, per-step times (first step "
        "apart from the steady state), and peak memory (VRAM on CUDA, process RAM on CPU). Put it last "
        "on the MODEL path and add an 'sdopt Profile Report' node after the sampler to see the results."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "label": ("STRING", {"default": "baseline", "tooltip": "Names this model's runs in the report."}),
            }
        }

    def apply(self, model, label):
        label = label.strip()
        if not label:
            raise ValueError("SDOptProfiler: 'label' is empty: give the runs a name, e.g. 'baseline'")
        install_node_timer(current_prompt_id(), current_node_id())
        return (attach_profiler(model.clone(), label),)


def build_report(prompt_id: str, prompt: dict | None = None) -> Report:
    note = None
    if not prompt_runs(prompt_id) and any(n.get("class_type") == "SDOptProfiler" for n in (prompt or {}).values()):
        note = (
            "No sampling ran in this prompt: ComfyUI reused cached results. "
            "Change the seed or another sampler input to profile again."
        )
    return Report(
        device=device_name(comfy.model_management.get_torch_device()),
        comfyui=_comfyui_version(),
        runs=prompt_runs(prompt_id),
        nodes=node_timings(prompt_id),
        optimizations=prompt_notes(prompt_id),
        note=note,
    )


class SDOptProfileReport:
    DESCRIPTION = (
        "Shows the profile of this prompt's sampling runs as a table and a chart, and saves the JSON "
        "report in the output folder. Connect the decoded images (or the sampled latent) so it runs "
        "after sampling. It re-runs on every queue."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "filename_prefix": ("STRING", {"default": "sdopt/profile"}),
            },
            "optional": {
                "images": ("IMAGE", {"tooltip": "Connect after VAEDecode so the report covers the whole run."}),
                "latent": ("LATENT", {"tooltip": "Or connect the sampler's LATENT."}),
            },
            "hidden": {"prompt": "PROMPT"},
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def report(self, filename_prefix, images=None, latent=None, prompt=None):
        if images is None and latent is None:
            raise ValueError(
                "SDOptProfileReport: connect 'images' (from VAEDecode) or 'latent' (from the sampler) "
                "so the report runs after sampling"
            )
        report = build_report(current_prompt_id(), prompt)
        output_dir = folder_paths.get_output_directory()
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, output_dir)
        base = f"{name}_{counter:05}_"
        json_path = report.save_json(os.path.join(folder, base + ".json"))
        report.save_chart(os.path.join(folder, base + ".png"))
        table = report.markdown()
        return {
            "ui": {
                "text": [table],
                "images": [{"filename": base + ".png", "subfolder": subfolder, "type": "output"}],
                "sdopt_report": [report.to_dict()],
                "sdopt_report_path": [str(json_path)],
            }
        }
