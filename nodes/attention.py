"""SDOptAttention (MODEL → MODEL): the diffusion model's attention through an sdopt backend.

ComfyUI (0.3.60 and newer) hands every attention call to
``transformer_options["optimized_attention_override"]`` when the model carries one; the node sets it
on a clone. Calls that ask for what sdopt's backends do not take (a custom ``scale``, grouped-query
``enable_gqa``) are handed back to ComfyUI's own function, and the record says so.
"""
import torch

from ..errors import Unavailable
from ..measure.profiler import active_run
from ..optim.attention import AUTO, LOW_MEMORY, SELECTIONS, AttentionConfig, NoAttentionBackend, attention_choices, attention_memory_is_linear, build_attention, expected_backend, packed_heads, runs_low_precision, summarize_decisions
from . import environment, patching
from .base import PatchNode
from .inputs import on_unavailable_input

NODE = "SDOptAttention"
OVERRIDE_KEY = "optimized_attention_override"
# True on the overrides this pack sets: they never read a block's place from ComfyUI's options, so
# regional compile may leave it out (an override from elsewhere might)
POSITION_BLIND = "sdopt_position_blind"
NO_OVERRIDE = Unavailable("this ComfyUI has no per-model attention override (needs 0.3.60 or newer)", "update ComfyUI", "backend")
DELEGATED = ("calls with a custom scale, grouped-query attention, a request for full-precision attention (from a low-precision "
             "backend) or inputs no sdopt backend takes ran ComfyUI's own function")


BACKEND_TOOLTIP = (f"{AUTO}: the fastest exact backend, timed on the first call of each shape. {LOW_MEMORY}: exact, in "
                   "the least memory. The others force one backend.")


def attention_inputs() -> dict:
    """The inputs both attention nodes share, with tooltips."""
    return {
        "backend": (list(attention_choices()), {"default": AUTO, "tooltip": BACKEND_TOOLTIP}),
        "on_unavailable": on_unavailable_input("fallback: run sdpa instead and say so in the report; error: stop with the reason."),
        "slice_size": ("INT", {"default": 0, "min": 0, "max": 1 << 20, "tooltip": "Query tokens per slice for sliced; 0 = sized from memory_budget_mb."}),
        "memory_budget_mb": ("INT", {"default": 32, "min": 1, "max": 1 << 20, "tooltip": "Score memory in MiB of one slice or chunk, for sliced, sub_quadratic and low_memory's chunks."}),
    }


def shortfall(requested: str, active: str, delegated: bool = False) -> str:
    """One line where attention ran other than asked: another backend, or ComfyUI's own for some calls."""
    parts = []
    ran = [name for name in active.split(", ") if name]
    if requested not in SELECTIONS and ran and any(name != requested for name in ran):
        parts.append(f"ran {active} instead of {requested}")
    if delegated:
        parts.append("some calls ran ComfyUI's own attention (custom scale, grouped-query or full precision asked)")
    return "; ".join(parts)


def configure(backend, on_unavailable, slice_size, memory_budget_mb, device) -> tuple[AttentionConfig, str, str]:
    """The config and the (active, note) known before any tensor exists."""
    config = AttentionConfig(backend=backend, on_unavailable=on_unavailable, slice_size=slice_size, memory_budget_bytes=memory_budget_mb << 20)
    return config, *expected_backend(config, device)


def comfy_attention_override(attention, report, low_precision: bool = False):
    """An override running ``attention`` on ComfyUI's arguments, as ``attention_pytorch`` reads them.
    Calls it cannot take (a custom scale, grouped-query attention, inputs that no backend takes
    when falling back, and, where ``attention`` is ``low_precision``, a model's request for
    ``low_precision_attention=False``) run ComfyUI's own function, and ``report(delegated=True)`` says so."""
    run = packed_heads(attention)

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        def comfy_own():
            report(delegated=True)
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)

        if kwargs.get("scale") is not None or kwargs.get("enable_gqa") or (low_precision and kwargs.get("low_precision_attention") is False):
            return comfy_own()
        precision = getattr(environment.comfy_attention(), "get_attn_precision", lambda p, d: p)(attn_precision, q.dtype)
        try:
            out = run(q, k, v, heads, mask, skip_reshape, skip_output_reshape, upcast=precision == torch.float32)
        except NoAttentionBackend:
            return comfy_own()
        report()
        return out

    setattr(override, POSITION_BLIND, True)
    return override


class SDOptAttention(PatchNode):
    DESCRIPTION = (
        "Runs the diffusion model's attention through the backend you pick, on a copy. auto times the exact "
        "backends on the first call of each shape and keeps the fastest; low_memory uses the least memory."
    )

    @classmethod
    def inputs(cls):
        return attention_inputs()

    def patch(self, model, backend, on_unavailable, slice_size, memory_budget_mb):
        m = patching.patched_clone(model, NODE)
        if not hasattr(environment.comfy_attention(), "wrap_attn"):
            patching.fall_back_or_raise(on_unavailable, NO_OVERRIDE, "run ComfyUI's own attention")
            patching.record_model(m, NODE, backend, "ComfyUI default", "fallback: this ComfyUI has no per-model attention override (0.3.60+)",
                              "runs ComfyUI's own attention: this ComfyUI has no per-model override")
            return (m,)
        config, active, note = configure(backend, on_unavailable, slice_size, memory_budget_mb, model.load_device)
        attention, reported = build_attention(config), {"state": None, "delegated_in": None}

        def report(delegated=False):
            if torch.compiler.is_compiling():  # decisions are filed by the eager first call of each shape
                return
            run = active_run()
            if delegated:
                reported["delegated_in"] = run
            state = (run, len(attention.decisions), reported["delegated_in"] is run)
            if state != reported["state"] and (state[1] or state[2]):
                picked, why = summarize_decisions(attention.decisions) if state[1] else ("ComfyUI's own", "")
                patching.record_in_run(NODE, backend, picked, "; ".join(filter(None, [why, DELEGATED if state[2] else ""])),
                                   shortfall(backend, picked if state[1] else "", state[2]))
                reported["state"] = state

        def report_after_sampling(executor, *args, **kwargs):
            # under a traced or compiled forward no attention call of a later run reaches Python
            try:
                return executor(*args, **kwargs)
            finally:
                report()

        patching.set_wrappers(m, NODE, {"SAMPLER_SAMPLE": report_after_sampling})
        transformer_options = dict(m.model_options.get("transformer_options", {}))
        transformer_options[OVERRIDE_KEY] = comfy_attention_override(attention, report, runs_low_precision(backend))
        m.model_options["transformer_options"] = transformer_options
        patching.set_attention_memory_profile(m, attention_memory_is_linear(backend if backend in (AUTO, LOW_MEMORY) else active))
        patching.record_model(m, NODE, backend, active, note, shortfall(backend, active))
        return (m,)
