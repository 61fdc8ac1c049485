"""How sdopt patches ComfyUI's objects, in one place.

- **Keyed wrappers**: ``patched_clone`` clones a model and sets one node's wrappers under its key,
  removing that key's earlier wrappers first, so a node chained twice replaces, never stacks.
- **Freed host memory**: every model and VAE an sdopt node returns hands the C heap's free pages back
  to the OS after each sampling run and each outermost decode/encode (``optim.heap_trim``).
- **Records**: ``record_model``/``record_vae`` file a node's record on the clone or VAE copy it
  returns; the profiler copies a model's records into each run, and a patched VAE files its own
  into the prompt on every decode/encode, so records survive nodes that ComfyUI serves from cache.
- **Inputs**: ``check_inputs`` holds a node's values to what its ``INPUT_TYPES`` promises,
  ``fall_back_or_raise`` turns a technique's ``Unavailable`` into the node's ``on_unavailable`` choice,
  and ``output_file_base`` keeps a ``filename_prefix`` inside ComfyUI's output folder.
- **Private model copies**: ``private_copy`` gives a diffusion model its own converted weights
  and a patcher that carries the input's patches, options, wrappers and callbacks; the weights are
  converted from those the model had before any sdopt copy, so chained copies round once.
- **VAE copies**: ComfyUI has no ``VAE.clone()``; ``wrap_vae_methods`` returns a shallow copy
  whose decode/encode (tiled too) run through a wrapper bound to the copy.
- **The model's family**: ``model_family`` finds what ``families/`` says of a patcher's model (its
  diffusion call, its blocks) from ComfyUI's config class; the fast path binds the diffusion
  model's inputs from it.

The per-prompt context lives in ``prompt_context``, the chain of UNet-forward techniques in
``fast_path``. Every difference between ComfyUI versions is feature-detected here, never read from a
version string.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import sys
import types
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import Unavailable, UserError
from ..families import SD15, DiffusionCall, Family, family_of_config_class
from ..measure.profiler import active_run
from ..measure.record import record
from ..measure.report import CLASSIC_MEMORY, DYNAMIC_VRAM
from ..optim.heap_trim import trim_heap
from .prompt_context import _filing_records

RECORDS_KEY = "sdopt_optimizations"
DEFAULT = "default"
VAE_METHODS = ("decode", "encode", "decode_tiled", "encode_tiled")
PATCHED_SUBJECTS = {"MODEL": "diffusion model", "VAE": "VAE"}


def patched_input(kind: str) -> tuple[str, dict]:
    """The input a patching node takes its MODEL or VAE from, with the tooltip that promises a copy."""
    return (kind, {"tooltip": f"The {PATCHED_SUBJECTS[kind]} to patch; it is never changed, the node returns a patched copy."})


# --- keyed wrappers and records on models ----------------------------------------------------------


def comfy_attention():
    from comfy.ldm.modules import attention

    return attention


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


def free_for_work(device: torch.device, patcher=None) -> int:
    """Bytes a node may use on ``device`` now, as ComfyUI plans: what the device can still allocate,
    plus what ComfyUI 0.38's dynamic VRAM would hand back from streamed weights (``patcher``'s view of
    free memory counts it), less the VRAM ComfyUI keeps for other applications (``--reserve-vram``)."""
    from comfy import model_management

    from ..optim.tiled_vae import free_memory

    free = free_memory(device)
    reserved = getattr(model_management, "extra_reserved_memory", None)
    if torch.device(device).type == "cpu" or not callable(reserved):
        return free
    if hasattr(patcher, "get_free_memory"):
        free += max(0, patcher.get_free_memory(torch.device(device)) - model_management.get_free_memory(torch.device(device)))
    return max(free - int(reserved()), 0)


def fall_back_or_raise(on_unavailable: str, problem: Unavailable | None, fallback: str) -> str | None:
    """Every node's ``on_unavailable`` choice, where a technique's ``unavailable(...)`` found a
    ``problem``: ``"error"`` raises a UserError filed under the input the fix concerns; ``"fallback"``
    returns the reason, for the record of what the node does instead (``fallback``, e.g. "run
    eager"). None where there is no problem."""
    if problem is None:
        return None
    if on_unavailable == "error":
        raise UserError(f"{problem.input}: {problem.reason}; {problem.fix} (or set on_unavailable to fallback to {fallback})")
    return problem.reason


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


# --- a call's rows: what ComfyUI's transformer_options say about the batch ------------------------

# Set on the transformer_options of one part of a batch split into sequential calls (Low Memory's
# sequential cfg): the part's rows of the whole batch. Parts have equal shapes, so the step caches
# need it to tell one part's call from another's.
BATCH_ROWS = "sdopt_batch_rows"


def call_key(transformer_options: dict) -> tuple:
    """What a step cache files a model call under: the conditionings it batches (ComfyUI's
    ``cond_or_uncond``) and, for one part of a split batch, its rows."""
    return tuple(transformer_options.get("cond_or_uncond") or ()), transformer_options.get(BATCH_ROWS)


def label_batch_rows(rows: slice, batch: int, args: tuple, kwargs: dict) -> None:
    """Make each transformer_options among a part's arguments describe the part's own rows: ComfyUI lists
    one ``cond_or_uncond`` and ``uuids`` entry per conditioning, each covering ``batch / entries`` rows
    (caches such as EasyCache split the batch by them), and the rows themselves (``BATCH_ROWS``)."""
    for options in (*args, *kwargs.values()):
        if not (isinstance(options, dict) and "cond_or_uncond" in options):
            continue
        entries = len(options["cond_or_uncond"] or ())
        if entries and batch % entries == 0:
            per_entry = batch // entries
            covered = slice(rows.start // per_entry, (rows.stop - 1) // per_entry + 1)
            for name in ("cond_or_uncond", "uuids"):
                if isinstance(options.get(name), list) and len(options[name]) == entries:
                    options[name] = options[name][covered]
        options[BATCH_ROWS] = (rows.start, rows.stop)


# --- inputs: what INPUT_TYPES promises, checked when the node runs --------------------------------


def _input_problem(kind, options: dict, value) -> str | None:
    if isinstance(kind, (list, tuple)):
        return None if value in kind else f"{value!r} is not offered (choose one of {', '.join(map(str, kind))})"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not true or false"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not text"
    if kind not in ("INT", "FLOAT"):
        return None  # a MODEL, VAE, LATENT...: ComfyUI checks the link's type
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "INT" and not whole:
        return f"{value!r} is not a whole number"
    if not (whole or isinstance(value, float)) or value != value:  # NaN is not a number either
        return f"{value!r} is not a number"
    if "min" in options and value < options["min"]:
        return f"{value} is below its minimum (give {options['min']} or more)"
    if "max" in options and value > options["max"]:
        return f"{value} is above its maximum (give {options['max']} or less)"
    return None


def output_file_base(filename_prefix: str) -> tuple[str, str, int, str]:
    """(folder, name, counter, subfolder) of the next file a node saves under ``filename_prefix`` in
    ComfyUI's output folder. A prefix that leaves that folder is ``filename_prefix``'s error, raised
    before ComfyUI's own check would log its refusal and raise a bare Exception."""
    import folder_paths

    output = os.path.abspath(folder_paths.get_output_directory())
    folder = os.path.abspath(os.path.join(output, os.path.dirname(os.path.normpath(filename_prefix))))
    if os.path.commonpath((output, folder)) != output:
        raise UserError(f"filename_prefix: {filename_prefix!r} leaves ComfyUI's output folder; give a path inside it, "
                        "e.g. sdopt/profile")
    return folder_paths.get_save_image_path(filename_prefix, output)[:4]


def check_inputs(node_class, **values) -> None:
    """A ``UserError`` with one message per input, each naming its own input, for every value that
    ``node_class.INPUT_TYPES()`` does not take: not among its options, of another type, or past an
    INT's or FLOAT's min or max. ComfyUI checks widget values so before a prompt runs, but not
    linked values, nor calls from Python."""
    spec = {name: entry for section in node_class.INPUT_TYPES().values() for name, entry in section.items()}
    problems = []
    for name, value in values.items():
        kind, options = spec[name][0], (spec[name][1] if len(spec[name]) > 1 else {})
        problem = _input_problem(kind, options, value)
        if problem:
            problems.append(f"{name}: {problem}")
    if problems:
        raise UserError("; ".join(problems))


# --- private copies of a diffusion model ---------------------------------------------------------


def _static(obj, name: str):
    """An attribute without triggering ``__getattr__`` (0.33's model config logs and returns None)."""
    return inspect.getattr_static(obj, name, None)


def is_quantized(model) -> bool:
    """Whether the diffusion model holds quantized weights (scaled fp8, int8, nvfp4...)."""
    config = model.model.model_config
    quantized = _static(config, "quant_config") is not None or _static(config, "scaled_fp8") is not None
    return quantized or any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.model.diffusion_model.parameters())


def refuse_quantized(model, input_name: str, fix: str) -> None:
    """A ``UserError`` under ``input_name`` when the model holds quantized weights, whose scales a
    converted copy would drop."""
    if is_quantized(model):
        raise UserError(
            f"{input_name}: this model holds quantized weights (scaled fp8, int8, nvfp4...), and a converted copy "
            f"would drop their scales; {fix} (ComfyUI runs quantized checkpoints natively)"
        )


# What ComfyUI 0.38's dynamic VRAM (comfy-aimdo) keeps on a model it manages, from the moment its
# patcher is made: address-space reservations, pinned host buffers and its patchers, on the model; and
# once loaded, on each layer: a staging slot, whose presence alone routes the layer's forward through
# aimdo, the slot's signature, the pinned buffers, the on-the-fly weight patch, and cast weights turned
# on, which no unload turns off; and after the layer's first forward, views over its VRAM window
# (weight, bias, the prefetch plan) and over pinned host memory, which no unload deletes either. A
# private copy takes none of it (the class defaults show again, as in a fresh load): sharing would let
# the copy touch the original's VRAM and pins, and a deep copy would read a window the unload just
# freed, duplicate pinned buffers or fail on native handles.
DYNAMIC_VRAM_MODEL_STATE = ("dynamic_vbars", "dynamic_pins", "dynamic_patchers")
DYNAMIC_VRAM_LAYER_STATE = DYNAMIC_VRAM_MODEL_STATE + (
    "_v", "_v_block", "_v_signature", "_pin_state", "weight_lowvram_function", "bias_lowvram_function", "comfy_cast_weights",
    "_v_weight", "_v_bias", "_v_block_faulted", "_prefetch", "_pins")


def _is_dynamic(patcher) -> bool:
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def _unload_everywhere(module: torch.nn.Module, given=None) -> None:
    """Unload every patcher that has ``module`` loaded, so its weights are the unpatched originals.

    ComfyUI 0.38's dynamic VRAM applies weight patches as each layer streams, so a module it manages
    holds its original weights while its unload leaves ``current_weight_patches_uuid`` set. Whether it
    manages ``module`` is read from the patchers, ``given`` (the node's input) and those loaded, and
    from the state it keeps on the module; ``module.current_patcher`` is set only while a sampler runs."""
    import comfy.model_management as mm

    patchers = [given] if given is not None and given.model is module else []
    for loaded in list(mm.current_loaded_models):
        if loaded.model is not None and loaded.model.model is module:
            patchers.append(loaded.model)
            loaded.model_unload()
            mm.current_loaded_models.remove(loaded)
    dynamic = any(_is_dynamic(p) for p in patchers) or any(hasattr(module, name) for name in DYNAMIC_VRAM_MODEL_STATE)
    if getattr(module, "current_weight_patches_uuid", None) is not None and not dynamic:
        raise RuntimeError("the model still has patched weights after unloading; cannot copy its original weights")


def _shallow_module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module sharing ``module``'s attributes but with its own parameter, buffer and child
    tables, so replacing a child on the copy leaves the original as it is."""
    duplicate = module.__class__.__new__(module.__class__)
    duplicate.__dict__.update(module.__dict__)
    for table in ("_parameters", "_buffers", "_modules"):
        duplicate.__dict__[table] = module.__dict__[table].copy()
    return duplicate


def rebased(patcher, module: torch.nn.Module):
    """A patcher of ``module`` with ``patcher``'s recipe: patches, options, wrappers, callbacks.

    Where ``clone`` takes a ``model_override`` (ComfyUI 0.33 and newer), ComfyUI builds it, as for
    its multi-GPU copies, non-dynamic, with fresh backups and no factory that reloads the original.
    Older ComfyUI: a new patcher gets every field of a clone that is not tied to the model.
    """
    parameters = inspect.signature(patcher.clone).parameters
    if "model_override" in parameters:
        backups = tuple(type(b)() for b in patcher.get_clone_model_override()[1])
        options = {"disable_dynamic": True} if "disable_dynamic" in parameters else {}
        clone = patcher.clone(model_override=(module, backups), **options)
        clone.cached_patcher_init = None
        clone.size = 0  # clone() passed the original's size; model_size() measures the copy instead
        # clone() shares these with the input, tied to the input's weights: hook LoRAs' weight backups and
        # cached patched weights, and the identity multi-GPU copies compare
        for name, fresh in (("hook_backup", dict), ("cached_hook_patches", dict), ("clone_base_uuid", uuid.uuid4)):
            if hasattr(clone, name):
                setattr(clone, name, fresh())
        return clone
    clone = patcher.clone()
    fresh = type(patcher)(module, patcher.load_device, patcher.offload_device, weight_inplace_update=patcher.weight_inplace_update)
    tied = {"model", "size", "backup", "object_patches_backup", "hook_backup", "hook_patches_backup", "cached_hook_patches",
            "patches_uuid", "parent", "is_injected", "pinned", "backup_buffers", "cached_patcher_init", "clone_base_uuid",
            "non_dynamic_delegate_model", "_last_prepare_log_key"}
    for name, value in vars(clone).items():
        if name not in tied and name in vars(fresh):
            setattr(fresh, name, value)
    return fresh


# A private copy's module → a weak reference to the module it was converted from, the weights as they
# were before any sdopt copy: a chained copy converts from those, so two nodes in a row round once,
# as the second alone would. Weak, so that a copy never keeps alive a model ComfyUI let go.
_copied_from: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SOURCE_FREED = "converted from the earlier sdopt copy's weights: the model it was copied from is no longer loaded"


def copy_source(module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module whose weights a private copy of ``module`` converts, a note): the module before
    any sdopt copy; ``module`` itself where it is no sdopt copy, or where its source was freed (noted)."""
    ref = _copied_from.get(module)
    source = ref() if ref is not None else None
    if source is None:
        return module, SOURCE_FREED if ref is not None else ""
    return source, ""


def loaded_weight_dtype(model) -> torch.dtype:
    """The diffusion model's weight dtype as ComfyUI loaded it: before any sdopt copy."""
    return copy_source(model.model)[0].get_dtype()


def _mark_copy(copied: torch.nn.Module, source: torch.nn.Module) -> None:
    _copied_from[copied] = weakref.ref(source)


def private_copy(model, convert: Callable[[torch.nn.Module], torch.nn.Module], notes: list[str] | None = None):
    """A patcher with the recipe of ``model`` over a BaseModel whose diffusion model is
    ``convert(original diffusion model)``, the original being the one before any sdopt copy;
    ``model`` and every clone of it are left as they are. ``notes`` gets a line where that
    original is gone and the input's weights were converted instead."""
    import comfy.model_management as mm

    base = model.model
    source, note = copy_source(base)
    _unload_everywhere(source, model)
    copied = _shallow_module_copy(base)
    for name in DYNAMIC_VRAM_MODEL_STATE:
        copied.__dict__.pop(name, None)
    copied.diffusion_model = convert(source.diffusion_model)
    copied.current_patcher = copied.current_weight_patches_uuid = None  # a dynamic unload leaves the uuid set
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(copied.diffusion_model)
    _mark_copy(copied, source)
    if note and notes is not None:
        notes.append(note)
    return rebased(model, copied)


def private_vae_copy(vae, convert: Callable[[torch.nn.Module], torch.nn.Module], notes: list[str] | None = None):
    """A copy of ``vae`` with its own ``convert``-ed weights, converted from the VAE's weights before
    any sdopt copy, and its own patcher; ``notes`` as for ``private_copy``."""
    import comfy.model_management as mm

    source, note = copy_source(vae.first_stage_model)
    _unload_everywhere(source, vae.patcher)
    duplicate = copy_vae(vae)
    duplicate.first_stage_model = convert(source)
    duplicate.first_stage_model.current_weight_patches_uuid = None  # as private_copy's: a fresh VAE's state
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(duplicate.first_stage_model)
    duplicate.patcher = rebased(vae.patcher, duplicate.first_stage_model)
    _mark_copy(duplicate.first_stage_model, source)
    if note and notes is not None:
        notes.append(note)
    return duplicate


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
            setattr(patched, name, types.MethodType(_trimming_heap_when_outermost(_filing_records(wrap(name, method.__func__))), patched))
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


# --- the model's family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFamily:
    """The family of a patcher's model, found from ComfyUI's config class (``config_class``).

    ``family`` is None where sdopt does not know that class. ``described`` is then the LDM UNet
    that sdopt served before it knew families (SD1.5's call and blocks): that keeps working for
    every model ComfyUI calls the same way, and ``label`` and ``unknown_note`` say it was assumed.
    """

    family: Family | None
    config_class: str

    @property
    def described(self) -> Family:
        return self.family or SD15

    @property
    def call(self) -> DiffusionCall:
        return self.described.call

    @property
    def label(self) -> str:
        return self.family.title if self.family else f"family unknown ({self.config_class})"

    @property
    def unknown_note(self) -> str:
        """What a record says where the family is unknown; empty where it is known."""
        if self.family:
            return ""
        return f"{self.label}: its diffusion model is called as {SD15.title}'s UNet is ({', '.join(SD15.call.tensor_inputs)})"


def model_family(model) -> ModelFamily:
    """The family of the model ``model`` (a ModelPatcher) holds."""
    config = _static(model.model, "model_config")
    config_class = type(config) if config is not None else type(model.model)
    return ModelFamily(family_of_config_class(config_class), config_class.__name__)


def inference_dtypes(model) -> tuple[torch.dtype, ...] | None:
    """The dtypes ComfyUI runs this model in, its preferred first (``supported_inference_dtypes``);
    None where its config does not say."""
    config = _static(model.model, "model_config")
    dtypes = getattr(config, "supported_inference_dtypes", None)
    return tuple(dtypes) if dtypes else None


# --- what this ComfyUI offers: its version, dynamic VRAM ---------------------------------------------


def comfyui_version() -> str | None:
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return __version__


def aimdo_installed() -> bool:
    """Whether comfy-aimdo (dynamic VRAM's allocator) can be imported here: imported already, blocked
    (None in ``sys.modules``), or findable."""
    if "comfy_aimdo" in sys.modules:
        return sys.modules["comfy_aimdo"] is not None
    return importlib.util.find_spec("comfy_aimdo") is not None


def memory_mode(device) -> tuple[str | None, str]:
    """(mode, note): whether ComfyUI manages memory with 0.38's dynamic VRAM or classically in this
    process, None where this ComfyUI has no dynamic VRAM; the note says where ComfyUI would start it on
    this GPU by default and was told not to (``--disable-dynamic-vram``, sdopt's ``--memory-mode classic``)."""
    memory_management = sys.modules.get("comfy.memory_management")
    if not hasattr(memory_management, "aimdo_enabled"):
        return None, ""
    if memory_management.aimdo_enabled:
        return DYNAMIC_VRAM, ""
    cli_args = sys.modules.get("comfy.cli_args")
    turned_off = getattr(getattr(cli_args, "args", None), "disable_dynamic_vram", False)
    if torch.device(device).type == "cuda" and turned_off and aimdo_installed():
        return CLASSIC_MEMORY, ("dynamic VRAM turned off (--disable-dynamic-vram or --memory-mode classic), where ComfyUI "
                                "turns it on by default on this GPU: these figures are classic memory management's")
    return CLASSIC_MEMORY, ""


def dynamic_vram_probe(device) -> Callable[[], int] | None:
    """Where ComfyUI 0.38's dynamic VRAM is on: the bytes on ``device`` mapped past PyTorch's allocator
    (streamed weights, malloc graphs); else None. comfy-aimdo hooks every device allocation in the
    process, on every GPU, so its total counts PyTorch's own segments on each too, which the probe takes
    off; what it maps on another GPU counts as this one's (ComfyUI runs a model on one)."""
    memory_management = sys.modules.get("comfy.memory_management")
    if not getattr(memory_management, "aimdo_enabled", False):
        return None
    try:
        from comfy_aimdo import control
    except ImportError:
        return None
    usage = getattr(control, "get_total_vram_usage", None)
    if usage is None or torch.device(device).type != "cuda":
        return usage
    return lambda: max(0, usage() - sum(torch.cuda.memory_reserved(index) for index in range(torch.cuda.device_count())))


DELEGATE_NOTE = "dynamic VRAM patcher: running on its non-dynamic delegate, which ComfyUI loads again from the checkpoint file"


def non_dynamic_clone(model) -> tuple[object, str, Unavailable | None]:
    """(clone, note, problem): a clone that ComfyUI 0.38's dynamic VRAM does not stream (graphs,
    compiled code and a per-model VRAM budget need fixed weight addresses), as ComfyUI's own
    TorchCompileModel makes it. Where ComfyUI cannot make one (the model came from a loader that
    leaves no way to load it again), a plain clone and the problem, for the node's ``on_unavailable``."""
    if not (_is_dynamic(model) and hasattr(model, "get_non_dynamic_delegate")):
        return model.clone(), "", None
    try:
        return model.get_non_dynamic_delegate(), DELEGATE_NOTE, None
    except RuntimeError as failure:
        return model.clone(), "", Unavailable(
            f"ComfyUI's dynamic VRAM streams this model and cannot load a copy of it without ({str(failure).splitlines()[0]})",
            "load it with a checkpoint or diffusion-model loader, or start ComfyUI with dynamic VRAM off", "model")
