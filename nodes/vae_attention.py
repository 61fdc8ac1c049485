"""SDOptVAEAttention (VAE → VAE): the VAE's attention blocks through an sdopt backend.

The VAE's ``AttnBlock``s call their own ``optimized_attention``, chosen at construction, which the
per-model override never reaches. The node returns a VAE copy whose decode/encode set it on the
shared blocks for the duration of the call and restore it afterwards; when patched copies are
chained, the outermost call (the node furthest downstream) decides.
"""
import contextlib

from ..measure.record import record
from ..optim.attention import build_attention, channel_attention, summarize_decisions
from . import patching, prompt_context
from .attention import attention_inputs, configure, shortfall
from .base import PatchNode

NODE = "SDOptVAEAttention"
_MARK = "_sdopt_vae_attention"


def attention_blocks(vae) -> list:
    """The VAE modules that carry their own ``optimized_attention`` (ComfyUI's ``AttnBlock``)."""
    return [module for module in vae.first_stage_model.modules() if "optimized_attention" in vars(module)]


@contextlib.contextmanager
def patched_blocks(blocks: list, fn):
    saved = [(block, block.optimized_attention) for block in blocks if not getattr(block.optimized_attention, _MARK, False)]
    for block, _ in saved:
        block.optimized_attention = fn
    try:
        yield
    finally:
        for block, original in saved:
            block.optimized_attention = original


class SDOptVAEAttention(PatchNode):
    DESCRIPTION = (
        "Runs the VAE's attention blocks through an sdopt backend while it decodes or encodes, e.g. sub_quadratic "
        "to bound a large decode's memory. Same backends as sdopt Attention."
    )
    PATCHES = "VAE"

    @classmethod
    def inputs(cls):
        return attention_inputs()

    def patch(self, vae, backend, on_unavailable, slice_size, memory_budget_mb):
        if not attention_blocks(vae):
            out = patching.wrap_vae_methods(vae, lambda _name, inner: inner)
            patching.record_vae(out, NODE, backend, "none", "this VAE has no attention blocks; nothing to patch")
            return (out,)
        config, active, note = configure(backend, on_unavailable, slice_size, memory_budget_mb, getattr(vae, "device", None))
        attention = build_attention(config)
        fn = channel_attention(attention)
        setattr(fn, _MARK, True)

        def wrap(_name, inner):
            def call(self, *args, **kwargs):
                with patched_blocks(attention_blocks(self), fn):
                    output = inner(self, *args, **kwargs)
                if attention.decisions:
                    picked, why = summarize_decisions(attention.decisions)
                    record(prompt_context.prompt_log().records, NODE, backend, picked, why, shortfall(backend, picked))
                return output

            return call

        out = patching.wrap_vae_methods(vae, wrap)
        patching.record_vae(out, NODE, backend, active, note, shortfall(backend, active))
        return (out,)
