"""SDOptDoctor (output node): ``python -m sdopt doctor`` inside the running ComfyUI, shown on the node.

The checks are ``nodes/checks``; this face reads ComfyUI from the live process (its device, its
version, whether dynamic VRAM is on), sends the rows to the browser as one ``sdopt.doctor`` event
(web/sdopt.js renders them in the node), and saves them as JSON in the output folder.
"""
import json
import os

from . import prompt_context
from .base import SavingNode
from .checks import CHECKS, comfyui_device, comfyui_info, doctor_table, run_checks, summary
from .inputs import output_file_base

NODE = "SDOptDoctor"
EVENT = "sdopt.doctor"


def _comfyui_root() -> str | None:
    import folder_paths

    return getattr(folder_paths, "base_path", None)


class SDOptDoctor(SavingNode):
    DESCRIPTION = (
        "Tries what sdopt needs on this machine, one tiny run each: device, dtypes, attention backends, compile, "
        "CUDA graphs, ComfyUI, and each sdopt node's modes. Each row gives the result and the fix."
    )
    FUNCTION = "examine"
    PREFIX_DEFAULT, PREFIX_TOOLTIP = "sdopt/doctor", "Where the JSON rows are saved, under the output folder."

    def examine(self, filename_prefix, unique_id=None):
        import comfy.utils

        folder, name, counter, subfolder = output_file_base(filename_prefix)
        bar = comfy.utils.ProgressBar(len(CHECKS))
        rows = run_checks(comfyui_device(), comfyui_info(_comfyui_root(), in_server=True), lambda _name: bar.update(1))
        path = os.path.join(folder, f"{name}_{counter:05}_.json")
        with open(path, "w") as file:
            json.dump([row.to_dict() for row in rows], file, indent=2)
        prompt_context.send_to_client(EVENT, {"node": str(unique_id), "checks": [row.to_dict() for row in rows], "summary": summary(rows),
                                    "table": doctor_table(rows), "json": {"filename": os.path.basename(path), "subfolder": subfolder, "type": "output"},
                                    "path": path})
        return {"ui": {}}
