"""SDOptAttention (MODEL → MODEL) and SDOptVAEAttention (VAE → VAE): attention through sdopt's backends.

Two nodes, because ComfyUI reaches the two models' attention in different ways:

- The diffusion model's attention goes through ``wrap_attn``, which hands every call to
  ``transformer_options["optimized_attention_override"]`` when a model carries one. The node
  sets it on a clone; the given model is untouched. The override is a plain closure on purpose:
  ``model_options`` is deep-copied on every clone, and functions survive a deep copy by
  reference, so downstream clones (LoRA, other patches) share one attention object and its
  per-shape decisions (which depend only on the inputs' shapes, dtype and device).
- The VAE's ``AttnBlock``\\ s call their own ``optimized_attention`` (q, k, v ``[B, C, H, W]``,
  one head of C channels), chosen once at construction. The node returns a shallow copy of the
  VAE whose ``decode``/``encode`` (and their tiled variants) set that attribute on the shared
  blocks for the duration of the call and restore it afterwards, so the given VAE, and every
  other copy of it, keep the stock attention.

``auto`` times every available backend on the first call of each input signature and keeps the
fastest that matches ``naive``; what it picked reaches the profiler's run (model) or the prompt's
notes (VAE). A requested backend that cannot run falls back to ``sdpa`` (or ``sub_quadratic``,
``naive``) with a note, or raises, as ``on_unavailable`` says.
"""
from __future__ import annotations

import contextlib

import torch
from comfy.ldm.modules import attention as comfy_attention

from ..errors import UserError
from ..optim.attention import (
    AUTO,
    DEFAULT_MEMORY_BUDGET_BYTES,
    HALF_DTYPES,
    ON_UNAVAILABLE,
    AttentionConfig,
    attention_choices,
    backend_names,
    build_attention,
    get_backend,
    resolve_backend_for_device,
    summarize_decisions,
)
from ..optim.profiler import active_run, note_optimization
from .records import add_optimization_record, note_prompt_optimization
from .vae_copy import wrap_vae_methods

MODEL_NODE = "SDOptAttention"
VAE_NODE = "SDOptVAEAttention"
OVERRIDE_KEY = "optimized_attention_override"
_MARK = "_sdopt_vae_attention"  # on our VAE functions, so nested patched calls keep the outermost
AUTO_NOTE = "times every available backend on the first call of each input shape and keeps the fastest that matches naive"

# ComfyUI >= 0.3.60 routes attention through wrap_attn and honours a per-model override.
OVERRIDE_SUPPORTED = hasattr(comfy_attention, "wrap_attn")
_attn_precision = getattr(comfy_attention, "get_attn_precision", lambda precision, dtype: precision)


def _backend_tooltip() -> str:
    lines = [f"{AUTO}: {AUTO_NOTE}"]
    lines += [f"{name}: {get_backend(name).description}" for name in backend_names()]
    return "\n".join(lines)


def _inputs(first: tuple[str, str]) -> dict:
    name, kind = first
    return {
        "required": {
            name: (kind,),
            "backend": (list(attention_choices()), {"default": AUTO, "tooltip": _backend_tooltip()}),
            "on_unavailable": (
                list(ON_UNAVAILABLE),
                {
                    "default": "fallback",
                    "tooltip": "fallback: use sdpa (or sub_quadratic, naive) and say so in the report; "
                    "error: stop with the reason",
                },
            ),
            "slice_size": (
                "INT",
                {"default": 0, "min": 0, "max": 1 << 20, "tooltip": "query tokens per slice for 'sliced'; 0 = from the memory budget"},
            ),
            "memory_budget_mb": (
                "INT",
                {
                    "default": DEFAULT_MEMORY_BUDGET_BYTES >> 20,
                    "min": 1,
                    "max": 1 << 20,
                    "tooltip": "score memory of one slice or chunk for 'sliced' and 'sub_quadratic'",
                },
            ),
        }
    }


def _config(backend: str, on_unavailable: str, slice_size: int, memory_budget_mb: int) -> AttentionConfig:
    return AttentionConfig(
        backend=backend, on_unavailable=on_unavailable, slice_size=slice_size, memory_budget_bytes=memory_budget_mb << 20
    )


def _expected(config: AttentionConfig, device) -> tuple[str, str]:
    """(active, note) known before any tensor exists; raises UserError for 'error' when the
    backend's package or device is missing."""
    if config.backend == AUTO:
        return f"{AUTO} (pending)", AUTO_NOTE
    resolved = resolve_backend_for_device(config.backend, device, config.on_unavailable)
    return resolved.name, resolved.note


class _RunReporter:
    """Tells the profiled run what the attention ran: once per run, and again whenever a new
    input signature has been decided."""

    def __init__(self, requested: str, attention):
        self.requested = requested
        self.attention = attention
        self._noted = (None, 0)

    def __call__(self) -> None:
        run = active_run()
        decisions = self.attention.decisions
        if run is None or not decisions or (run, len(decisions)) == self._noted:
            return
        note_optimization(MODEL_NODE, self.requested, *summarize_decisions(decisions))
        self._noted = (run, len(decisions))


def comfy_attention_override(attention, reporter):
    """A ``transformer_options["optimized_attention_override"]`` that runs ``attention`` (the
    sdopt convention, ``[B, H, N, D]``) in place of ComfyUI's function, with its arguments
    (as ``attention_pytorch`` reads them), then calls ``reporter()``."""

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        batch = q.shape[0]
        if not skip_reshape:
            q, k, v = (t.reshape(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        if mask is not None:  # as attention_pytorch: [Nq, Nk] -> [1, 1, Nq, Nk], [B, Nq, Nk] -> [B, 1, Nq, Nk]
            if mask.ndim == 2:
                mask = mask.unsqueeze(0)
            if mask.ndim == 3:
                mask = mask.unsqueeze(1)
        dtype = q.dtype
        if _attn_precision(attn_precision, dtype) == torch.float32 and dtype in HALF_DTYPES:
            q, k, v = q.float(), k.float(), v.float()
        out = attention(q, k, v, mask).to(dtype)
        reporter()
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1])

    return override


class SDOptAttention:
    DESCRIPTION = (
        "Runs the diffusion model's attention through an sdopt backend: sdpa (forced kernels too), "
        "xformers, sage, flash_attn, sliced, sub_quadratic, naive, or auto (times the available ones on "
        "the first call and keeps the fastest that matches naive). Returns a patched clone; the input model "
        "is untouched. A backend that cannot run falls back to sdpa with a note in the report, or raises."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return _inputs(("model", "MODEL"))

    def patch(self, model, backend, on_unavailable, slice_size, memory_budget_mb):
        config = _config(backend, on_unavailable, slice_size, memory_budget_mb)
        m = model.clone()
        if not OVERRIDE_SUPPORTED:
            message = "this ComfyUI has no per-model attention override (needs 0.3.60 or newer)"
            if on_unavailable == "error":
                raise UserError(message)
            add_optimization_record(m.model_options, MODEL_NODE, backend, "ComfyUI default", f"fallback: {message}")
            return (m,)
        active, note = _expected(config, model.load_device)
        attention = build_attention(config)
        transformer_options = dict(m.model_options.get("transformer_options", {}))
        if OVERRIDE_KEY in transformer_options:
            note = "; ".join(filter(None, [note, "replaces an earlier attention override"]))
        transformer_options[OVERRIDE_KEY] = comfy_attention_override(attention, _RunReporter(backend, attention))
        m.model_options["transformer_options"] = transformer_options
        add_optimization_record(m.model_options, MODEL_NODE, backend, active, note)
        return (m,)


def vae_attention_function(attention):
    """A VAE ``AttnBlock.optimized_attention`` (q, k, v ``[B, C, *spatial]``, one head of C
    channels) that runs ``attention``."""

    def vae_attention(q, k, v):
        shape = q.shape
        batch, channels = shape[:2]
        q, k, v = (t.reshape(batch, 1, channels, -1).transpose(-2, -1) for t in (q, k, v))
        return attention(q, k, v).transpose(-2, -1).reshape(shape)

    setattr(vae_attention, _MARK, True)
    return vae_attention


def vae_attention_blocks(vae) -> list:
    """The VAE modules that carry their own ``optimized_attention`` (ComfyUI's ``AttnBlock``)."""
    return [module for module in vae.first_stage_model.modules() if "optimized_attention" in vars(module)]


@contextlib.contextmanager
def patched_attention_blocks(blocks: list, fn):
    """Set ``optimized_attention`` on ``blocks`` for the duration, then restore what was there.

    Blocks that already run an sdopt function keep it: when patched VAE copies are chained, the
    outermost call (the node furthest downstream) decides.
    """
    saved = [(block, block.optimized_attention) for block in blocks if not getattr(block.optimized_attention, _MARK, False)]
    for block, _ in saved:
        block.optimized_attention = fn
    try:
        yield
    finally:
        for block, original in saved:
            block.optimized_attention = original


class SDOptVAEAttention:
    DESCRIPTION = (
        "Runs the VAE's attention blocks through an sdopt backend during its decode and encode (tiled "
        "too), e.g. sub_quadratic or sliced to bound the memory of large decodes. Returns a patched copy; "
        "the input VAE keeps its attention. The backends and fallback rule are those of sdopt Attention."
    )
    CATEGORY = "sdopt"
    RETURN_TYPES = ("VAE",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return _inputs(("vae", "VAE"))

    def patch(self, vae, backend, on_unavailable, slice_size, memory_budget_mb):
        config = _config(backend, on_unavailable, slice_size, memory_budget_mb)
        blocks = vae_attention_blocks(vae)
        if not blocks:
            note_prompt_optimization(VAE_NODE, backend, "none", "this VAE has no attention blocks; nothing to patch")
            return (vae,)
        active, note = _expected(config, getattr(vae, "device", None))
        note_prompt_optimization(VAE_NODE, backend, active, note)
        attention = build_attention(config)
        fn = vae_attention_function(attention)

        def report():
            if attention.decisions:
                note_prompt_optimization(VAE_NODE, backend, *summarize_decisions(attention.decisions))

        return (wrap_vae_methods(vae, lambda _name, inner: _with_attention(inner, fn, report)),)


def _with_attention(inner, fn, report):
    def call(self, *args, **kwargs):
        with patched_attention_blocks(vae_attention_blocks(self), fn):
            output = inner(self, *args, **kwargs)
        report()
        return output

    return call
