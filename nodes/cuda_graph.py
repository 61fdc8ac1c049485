"""SDOptCUDAGraph (MODEL → MODEL): replay the UNet from CUDA graphs, one per input signature.

Configures the clone's fast path (``fast_path.FastPath``): with SDOptCompile anywhere in the chain the
graph captures the compiled code. Calls a graph cannot serve run eagerly, and the report says why.
"""
import torch

from ..optim.cuda_graph import GraphConfig, unavailable
from . import fast_path, glue

NODE = "SDOptCUDAGraph"
ON_UNAVAILABLE = ("fallback", "error")


class SDOptCUDAGraph:
    DESCRIPTION = (
        "Captures the diffusion model's step into a CUDA graph on first use and replays it: one graph per "
        "resolution and batch, at most max_graphs kept. Weight changes (LoRA, strength, reload) recapture; "
        "ControlNet, attention patches and partially loaded models run eagerly, as the report says. "
        "With sdopt Compile anywhere in the chain it replays the compiled UNet: the fast path."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": glue.patched_input("MODEL"),
            "max_graphs": ("INT", {"default": 4, "min": 1, "max": 64, "tooltip": "Graphs kept (least recently used dropped first); each holds its own activations."}),
            "on_unavailable": (list(ON_UNAVAILABLE), {"default": "fallback", "tooltip": "On a machine without CUDA, or where ComfyUI's dynamic VRAM cannot give this node a non-dynamic copy of the model: pass the model through with a note in the report, or stop with an error."}),
        }}

    def patch(self, model, max_graphs, on_unavailable):
        glue.check_inputs(SDOptCUDAGraph, max_graphs=max_graphs, on_unavailable=on_unavailable)
        config = GraphConfig(max_graphs=max_graphs)
        requested = f"max_graphs={max_graphs}, on_unavailable={on_unavailable}"
        problem = unavailable(config, torch.device(model.load_device))
        m, path_note = fast_path.fast_path_clone(model, NODE, requested, problem, on_unavailable, fast_path.GRAPH, config)
        if path_note is not None:
            note = "; ".join(filter(None, [path_note, "captured on the first step of each input signature"]))
            glue.record_model(m, NODE, requested, f"CUDA graph, up to {max_graphs}", note)
        return (m,)
