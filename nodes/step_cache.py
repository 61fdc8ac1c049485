"""SDOptStepCache (MODEL → MODEL): DeepCache for UNets, on the clone's fast path.

Every ``interval`` model calls the whole UNet runs; the calls between run only its shallow branch on
the deep features the last full call kept (``optim.step_cache``). With SDOptCompile and SDOptCUDAGraph
in the chain the full and the shallow call are each compiled and captured once. The record gives the
calls computed against reused; the checkpoints sdopt generates have random weights, so an error
measured on them says nothing about a trained model's images.
"""
from ..optim.step_cache import MODES, StepCacheConfig, unavailable
from . import fast_path, glue

NODE = "SDOptStepCache"
ON_UNAVAILABLE = ("fallback", "error")
QUALITY_NOTE = "reuses deep features between full calls: its image differs from the uncached one; measure it (bench speed's cache rungs)"


class SDOptStepCache:
    DESCRIPTION = (
        "DeepCache for SD1.5 and SDXL UNets: the whole UNet runs every `interval` model calls, the calls "
        "between run only its outermost blocks on the deep features the last full call kept. Defaults are "
        "DeepCache's published settings (interval 3, branch 0). The image changes: compare it with the "
        "uncached one. Composes with sdopt Compile and CUDA Graph; ControlNet and attention patches run uncached."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model; it is never changed, the node returns a patched copy."}),
            "mode": (list(MODES), {"default": MODES[0], "tooltip": "deepcache: UNets (SD1.5, SDXL)."}),
            "interval": ("INT", {"default": 3, "min": 1, "max": 10, "tooltip": "The whole UNet runs every this many model calls; 1 caches nothing."}),
            "branch": ("INT", {"default": 0, "min": 0, "max": 11, "tooltip": "How many skip levels still run on a cached call, minus one: 0 runs only the outermost blocks (fastest)."}),
            "start": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": "Calls before this fraction of the schedule run the whole UNet."}),
            "end": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": "Calls from this fraction of the schedule on run the whole UNet."}),
            "on_unavailable": (list(ON_UNAVAILABLE), {"default": "fallback", "tooltip": "On a model that is not such a UNet: pass it through with a note in the report, or stop with an error."}),
        }}

    def patch(self, model, mode, interval, branch, start, end, on_unavailable):
        glue.check_inputs(SDOptStepCache, mode=mode, interval=interval, branch=branch, start=start, end=end, on_unavailable=on_unavailable)
        config = StepCacheConfig(mode, interval, branch, start, end)
        requested = f"{config.settings()}, on_unavailable={on_unavailable}"
        blocks = fast_path.comfy_unet_blocks(model.model.diffusion_model)
        problem = unavailable(config, model.load_device, blocks=blocks)
        m, path_note = fast_path.fast_path_clone(model, NODE, requested, problem, on_unavailable, fast_path.STEP_CACHE, config)
        if path_note is not None:
            fast_path.fast_path_of(m).notes[NODE] = lambda: QUALITY_NOTE
            glue.record_model(m, NODE, requested, config.settings(), "; ".join(filter(None, [path_note, QUALITY_NOTE])))
        return (m,)
