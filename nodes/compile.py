"""SDOptCompile (MODEL → MODEL): the UNet through torch.compile, regional compile or a trace.

The node only configures the clone's fast path (``glue.FastPath``); compilation happens on the
first sampling step, and the profiler report gives its count, time and guard-failure reasons.
"""
from ..optim.compile import BACKENDS, COMPILE_MODES, MODES, CompileConfig, unavailable_reason
from . import glue

NODE = "SDOptCompile"
ON_UNAVAILABLE = ("fallback", "error")


class SDOptCompile:
    DESCRIPTION = (
        "Compiles the diffusion model on its first step: compile (torch.compile of the whole UNet), "
        "compile_regional (each repeated block class compiled and shared by its instances) or trace "
        "(torch.jit.trace). Steps, seed, sampler, scheduler, CFG and prompt never recompile; a new resolution "
        "compiles once. LoRA and other weight changes are used without recompiling. Compiled code is cached on "
        "disk per architecture, torch version and settings (python -m sdopt cache list|purge). Put sdopt CUDA "
        "Graph after or before it for the fast path."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model; it is never changed, the node returns a patched copy."}),
            "mode": (list(MODES), {"default": "compile", "tooltip": "compile: whole UNet. compile_regional: each repeated block class, once per weight shape and block position; on SD1.5 it saves little compile time and recompiles per resolution, it pays off where repeated blocks share one shape. trace: torch.jit.trace per resolution."}),
            "backend": (list(BACKENDS), {"default": "inductor", "tooltip": "torch.compile backend (compile modes only)."}),
            "compile_mode": (list(COMPILE_MODES), {"default": "default", "tooltip": "inductor mode. Prefer default or max-autotune-no-cudagraphs with sdopt CUDA Graph: reduce-overhead makes its own graphs."}),
            "dynamic": ("BOOLEAN", {"default": False, "tooltip": "Dynamic shapes: one compile for all resolutions, slower code."}),
            "fullgraph": ("BOOLEAN", {"default": False, "tooltip": "Fail on a graph break instead of splitting the graph."}),
            "on_unavailable": (list(ON_UNAVAILABLE), {"default": "fallback", "tooltip": "When this machine cannot compile (no Triton, no C++ compiler): run eager with a note in the report, or stop with an error."}),
        }}

    def patch(self, model, mode, backend, compile_mode, dynamic, fullgraph, on_unavailable):
        config = CompileConfig(mode, backend, compile_mode, dynamic, fullgraph)
        requested = f"{config.settings()}, on_unavailable={on_unavailable}"
        reason, fix = unavailable_reason(config, model.load_device) or (None, "")
        fix += " (or set on_unavailable to fallback to run eager)"
        m, path_note = glue.fast_path_clone(model, NODE, requested, reason, on_unavailable, "backend", fix, compile_config=config)
        if path_note is not None:
            how = "compiles on the first steps" if mode != "trace" else "traced per resolution; not frozen, since ComfyUI may patch weights in place"
            glue.record_model(m, NODE, requested, config.settings(), "; ".join(filter(None, [path_note, how])))
        return (m,)
