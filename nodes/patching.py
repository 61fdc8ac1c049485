"""How sdopt patches ComfyUI's models and VAEs: keyed wrappers, records, freed host memory, VAE copies.

- **Keyed wrappers**: ``patched_clone`` clones a model and sets one node's wrappers under its key,
  removing that key's earlier wrappers first, so a node chained twice replaces, never stacks.
- **Freed host memory**: every model and VAE an sdopt node returns hands the C heap's free pages back
  to the OS after each sampling run and each outermost decode/encode (``optim.heap_trim``).
- **Records**: ``record_model``/``record_vae`` file a node's record on the clone or VAE copy it
  returns; the profiler copies a model's records into each run, and a patched VAE files its own
  into the prompt on every decode/encode, so records survive nodes that ComfyUI serves from cache.
  ``fall_back_or_raise`` turns a technique's ``Unavailable`` into the node's ``on_unavailable`` choice.
- **VAE copies**: ComfyUI has no ``VAE.clone()``; ``wrap_vae_methods`` returns a shallow copy
  whose decode/encode (tiled too) run through a wrapper bound to the copy.
"""
from __future__ import annotations

import copy
import inspect
import sys
import types
from collections.abc import Callable

from ..errors import Unavailable, UserError
from ..measure.profiler import active_run
from ..measure.record import record
from ..optim.heap_trim import trim_heap
from .prompt_context import filing_records

RECORDS_KEY = "sdopt_optimizations"


VAE_METHODS = ("decode", "encode", "decode_tiled", "encode_tiled")

# --- keyed wrappers and records on models ----------------------------------------------------------

def wrapper_types():
    import comfy.patcher_extension

    return comfy.patcher_extension.WrappersMP


HEAP_TRIM_KEY = "sdopt.heap_trim"


def _trimming_heap_after(executor, *args, **kwargs):
    try:
        return executor(*args, **kwargs)
    finally:
        trim_heap()


def _replace_keyed(model, key: str, wrappers: dict[str, Callable]) -> None:
    kinds = wrapper_types()
    for name in dir(kinds):
        if name.isupper():
            model.remove_wrappers_with_key(getattr(kinds, name), key)
    for name, fn in wrappers.items():
        model.add_wrapper_with_key(getattr(kinds, name), key, fn)


def set_wrappers(model, key: str, wrappers: dict[str, Callable]) -> None:
    """Make ``wrappers`` ({WrappersMP attribute name: fn}) the only ones of ``key`` on ``model``, and
    have every sampling run of ``model`` end by handing freed host memory back to the OS."""
    _replace_keyed(model, key, wrappers)
    trim_heap_after_sampling(model)


def make_outermost(model, key: str, kind: str) -> None:
    """Run ``key``'s wrappers of ``kind`` (a WrappersMP attribute name) outside every other key's on
    ``model``: ComfyUI runs a kind's keys in the order they were added, the first outermost."""
    by_key = getattr(model, "wrappers", {}).get(getattr(wrapper_types(), kind), {})
    if key in by_key:
        reordered = {key: by_key.pop(key), **by_key}
        by_key.clear()
        by_key.update(reordered)


def trim_heap_after_sampling(model) -> None:
    """Have every sampling run of ``model`` end by handing freed host memory back to the OS, its
    other wrappers left as they are."""
    _replace_keyed(model, HEAP_TRIM_KEY, {"OUTER_SAMPLE": _trimming_heap_after})


def patched_clone(model, key: str, wrappers: dict[str, Callable] | None = None):
    """A clone of ``model`` whose wrappers under ``key`` are exactly ``wrappers``."""
    clone = model.clone()
    set_wrappers(clone, key, wrappers or {})
    return clone


def model_records(model_options: dict) -> list[dict]:
    """The records on a model's options (read only: an empty list where there are none)."""
    return model_options.get(RECORDS_KEY, [])


def record_model(model, node: str, requested: str, active: str, note: str = "", short: str = "") -> None:
    record(model.model_options.setdefault(RECORDS_KEY, []), node, requested, active, note, short)


def record_in_run(node: str, requested: str, active: str, note: str = "", short: str = "") -> None:
    """Update a record in the sampling run being profiled, for what only sampling finds out."""
    run = active_run()
    if run is not None:
        record(run.optimizations, node, requested, active, note, short)


def fall_back_or_raise(on_unavailable: str, problem: Unavailable | None, fallback: str) -> str | None:
    """Every node's ``on_unavailable`` choice, where a technique's ``unavailable(...)`` found a
    ``problem``: ``"error"`` raises a UserError filed under the input the fix concerns; ``"fallback"``
    returns the reason and its fix, for the record of what the node does instead (``fallback``, e.g.
    "run eager"): a user who reads only the record learns what would make the node run. None where
    there is no problem."""
    if problem is None:
        return None
    if on_unavailable == "error":
        raise UserError(f"{problem.input}: {problem.reason}; {problem.fix} (or set on_unavailable to fallback to {fallback})")
    return f"{problem.reason} (fix: {problem.fix})"


ATTENTION_MEMORY_KEY = "optimized_attention_memory_efficient"


def set_attention_memory_profile(model, linear: bool | None) -> None:
    """Tell ComfyUI's memory estimate how the attention ``model`` now runs needs memory: linear in the
    tokens (True), quadratic (False), or as ComfyUI's own backend would (None: the key is dropped).
    Newer ComfyUI sizes a sampling run's working memory from ``model_options[ATTENTION_MEMORY_KEY]``
    (``estimate_memory`` passes it to ``BaseModel.memory_required(..., memory_efficient_attention=)``)
    and, without it, from the backend ComfyUI itself selected, whose profile need not be the override's.
    A ComfyUI whose ``memory_required`` takes no such argument gets nothing."""
    base_model = getattr(sys.modules.get("comfy.model_base"), "BaseModel", None)
    if base_model is None or "memory_efficient_attention" not in inspect.signature(base_model.memory_required).parameters:
        return
    if linear is None:
        model.model_options.pop(ATTENTION_MEMORY_KEY, None)
    else:
        model.model_options[ATTENTION_MEMORY_KEY] = linear

# --- VAE copies ------------------------------------------------------------------------------------

def copy_vae(vae):
    """A shallow copy whose methods bound to ``vae`` (an earlier node's wrapper) are bound to the
    copy, and whose records are its own."""
    duplicate = copy.copy(vae)
    for name, value in vars(vae).items():
        if isinstance(value, types.MethodType) and value.__self__ is vae:
            setattr(duplicate, name, types.MethodType(value.__func__, duplicate))
    duplicate.sdopt_records = [dict(r) for r in getattr(vae, "sdopt_records", [])]
    return duplicate


def record_vae(vae, node: str, requested: str, active: str, note: str = "", short: str = "") -> None:
    """File a record on a VAE copy; it reaches the report of every prompt that decodes or encodes with it."""
    record(vae.sdopt_records, node, requested, active, note, short)


def wrap_vae_methods(vae, wrap: Callable[[str, Callable], Callable]):
    """A copy of ``vae`` whose decode/encode methods are ``wrap(name, inner)``, each call filing the
    copy's records into the executing prompt first.

    ``inner(self, *args, **kwargs)`` is what the method did before (ComfyUI's own, or an earlier
    wrapper); ``wrap`` returns a function of the same form.
    """
    patched = copy_vae(vae)
    for name in VAE_METHODS:
        method = getattr(vae, name, None)
        if method is not None:
            setattr(patched, name, types.MethodType(_trimming_heap_when_outermost(filing_records(wrap(name, method.__func__))), patched))
    return patched


_vae_calls_open = 0


def _trimming_heap_when_outermost(fn: Callable) -> Callable:
    """``fn`` handing freed host memory back to the OS when it returns, unless it ran inside another
    sdopt VAE wrapper (chained VAE nodes nest; the outermost trims once)."""
    def call(self, *args, **kwargs):
        global _vae_calls_open
        _vae_calls_open += 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            _vae_calls_open -= 1
            if not _vae_calls_open:
                trim_heap()

    return call
