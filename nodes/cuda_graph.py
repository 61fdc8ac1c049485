"""SDOptCUDAGraph (MODEL → MODEL): replay the UNet from CUDA graphs, one per input signature.

Configures the clone's fast path (``fast_path.FastPath``): with SDOptCompile anywhere in the chain the
graph captures the compiled code. Calls a graph cannot serve run eagerly, and the report says why.
"""
import torch

from ..optim.cuda_graph import GraphConfig, GraphedFunction, module_weights, unavailable
from . import fast_path, patching
from .base import PatchNode
from .inputs import on_unavailable_input

NODE = "SDOptCUDAGraph"


class GraphMember(fast_path.ChainMember):
    """CUDA graphs on the fast path, outermost: a graph captures what the members inside it made
    (compiled code), per input signature, and never the other way round."""

    node, place, speed_only = NODE, 30, True

    def wrap(self, path, unet, fn, call, config, options):
        graphed = GraphedFunction(fn, module_weights(unet), config)
        return graphed, graphed, None

    def warmup(self, part):
        return fast_path.Warmup("capture", part.stats.captures, part.stats.capture_seconds)

    def record(self, path, config, state, parts, eager):
        return "CUDA graph: " + (" | ".join(part.stats.summary() for part in parts) or "no call ran from a graph"), eager.note, eager.short


CHAIN_MEMBER = GraphMember()


class SDOptCUDAGraph(PatchNode):
    DESCRIPTION = (
        "Captures the diffusion model's step into a CUDA graph on first use and replays it, one graph per size. "
        "Weight changes recapture. Put it after sdopt Compile for the fast path."
    )

    @classmethod
    def inputs(cls):
        return {
            "max_graphs": ("INT", {"default": 4, "min": 1, "max": 64, "tooltip": "Graphs kept (least recently used dropped first); each holds its own activations."}),
            "on_unavailable": on_unavailable_input("Without CUDA, or under dynamic VRAM without a non-dynamic copy: fallback passes the model on unchanged with a note, error stops."),
        }

    def patch(self, model, max_graphs, on_unavailable):
        config = GraphConfig(max_graphs=max_graphs)
        requested = f"max_graphs={max_graphs}, on_unavailable={on_unavailable}"
        problem = unavailable(config, torch.device(model.load_device))
        m, path_note = fast_path.fast_path_clone(model, CHAIN_MEMBER, requested, problem, on_unavailable, config)
        if path_note is not None:
            note = "; ".join(filter(None, [path_note, "captured on the first step of each input signature"]))
            patching.record_model(m, NODE, requested, f"CUDA graph, up to {max_graphs}", note)
        return (m,)
