"""SDOptProfileReport (output node): the prompt's profile as a table and a chart, saved as JSON.

The report is built once, here, and written once: the JSON and the chart go to the output folder,
and the report reaches the browser widget (web/sdopt.js) and the headless runner as one
``sdopt.report`` event, so the queue shows only the chart and no empty output cards. When ComfyUI
served the sampling from its cache, the node shows the last real figures it reported, marked cached.
"""
import hashlib
import json
import os
from collections import OrderedDict

from ..errors import UserError
from ..measure.report import Report, device_name
from . import environment, prompt_context
from .base import SavingNode
from .inputs import output_file_base

NODE = "SDOptProfileReport"
EVENT = "sdopt.report"
_KEPT_REPORTS = 16
_NO_SAMPLING = "No sampling ran in this prompt: ComfyUI reused cached results."
_PROFILE_AGAIN = "change the seed or another sampler input to profile again."
_last_sampled: OrderedDict[tuple[str, str], Report] = OrderedDict()


def build_report(prompt_id: str, node_id: str, prompt: dict | None) -> Report:
    import comfy.model_management

    log = prompt_context.prompt_log(prompt_id)
    device = comfy.model_management.get_torch_device()
    mode, mode_note = environment.memory_mode(device)
    report = Report(device=device_name(device), comfyui=environment.comfyui_version(), memory_mode=mode,
                    runs=list(log.runs), nodes=prompt_context.node_timings(prompt_id), optimizations=list(log.records),
                    notes=[mode_note] if mode_note else [])
    profiled = any(node.get("class_type") == "SDOptProfiler" for node in (prompt or {}).values())
    # The same report node in the same graph: another workflow's figures must never stand in for these.
    graph = json.dumps({k: v for k, v in (prompt or {}).items() if k != node_id}, sort_keys=True, default=str)
    key = (node_id, hashlib.sha256(graph.encode()).hexdigest())
    if report.runs or not profiled:
        _last_sampled[key] = report
        _last_sampled.move_to_end(key)
        while len(_last_sampled) > _KEPT_REPORTS:
            _last_sampled.popitem(last=False)
    elif key in _last_sampled:
        report = Report.from_dict(_last_sampled[key].to_dict())
        report.cached = True
        report.notes = [f"{_NO_SAMPLING} These are the last real figures of this node; {_PROFILE_AGAIN}"] + report.notes
    else:
        report.notes.append(f"{_NO_SAMPLING} {_PROFILE_AGAIN[0].upper()}{_PROFILE_AGAIN[1:]}")
    return report


class SDOptProfileReport(SavingNode):
    DESCRIPTION = (
        "Shows this prompt's profile as a table and a chart, and saves the JSON report. Connect the decoded "
        "images (or the latent) so it runs after sampling. It re-runs on every queue."
    )
    FUNCTION = "report"
    PREFIX_DEFAULT, PREFIX_TOOLTIP = "sdopt/profile", "Where the JSON report and the chart are saved, under the output folder."
    HIDDEN = {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}

    @classmethod
    def optional_inputs(cls):
        return {
            "images": ("IMAGE", {"tooltip": "Connect after VAEDecode so the report covers the whole run."}),
            "latent": ("LATENT", {"tooltip": "Or connect the sampler's LATENT."}),
        }

    def report(self, filename_prefix, images=None, latent=None, prompt=None, unique_id=None):
        if images is None and latent is None:
            raise UserError("images: connect 'images' (from VAEDecode) or 'latent' (from the sampler) so the report runs after sampling")
        folder, name, counter, subfolder = output_file_base(filename_prefix)
        report = build_report(prompt_context.current_prompt_id(), str(unique_id), prompt)
        base = f"{name}_{counter:05}_"
        chart = report.save_chart(os.path.join(folder, base + ".png"))
        report.save_json(os.path.join(folder, base + ".json"))
        entry = {"subfolder": subfolder, "type": "output"}
        images = [{**entry, "filename": base + ".png"}] if chart else []
        prompt_context.send_to_client(EVENT, {"node": str(unique_id), "report": report.to_dict(), "table": report.markdown(),
                     "json": {**entry, "filename": base + ".json"}, "chart": images[0] if images else None,
                     "path": os.path.join(folder, base + ".json")})
        return {"ui": {"images": images}}
