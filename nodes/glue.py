"""What every sdopt node needs from ComfyUI, in one place.

- **Keyed wrappers**: ``patched_clone`` clones a model and sets one node's wrappers under its key,
  removing that key's earlier wrappers first, so a node chained twice replaces, never stacks.
- **Records**: ``record_model``/``record_vae`` file a node's record on the clone or VAE copy it
  returns; the profiler copies a model's records into each run, and a patched VAE files its own
  into the prompt on every decode/encode, so records survive nodes that ComfyUI serves from cache.
- **Private model copies**: ``private_copy`` gives a diffusion model its own converted weights
  and a patcher that carries the input's patches, options, wrappers and callbacks; the weights are
  converted from those the model had before any sdopt copy, so chained copies round once.
- **VAE copies**: ComfyUI has no ``VAE.clone()``; ``wrap_vae_methods`` returns a shallow copy
  whose decode/encode (tiled too) run through a wrapper bound to the copy.
- **The per-prompt context**: the executing prompt and node, its profiled runs and records, and
  per-node wall time and peak memory through ComfyUI's progress registry (≈0.3.45 and newer).
- **The model's family**: ``model_family`` finds what ``families/`` says of a patcher's model (its
  diffusion call, its blocks) from ComfyUI's config class; the fast path binds the diffusion
  model's inputs from it.

Every difference between ComfyUI versions is feature-detected here, never read from a version string.
"""
from __future__ import annotations

import copy
import functools
import inspect
import sys
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..errors import Unavailable, UserError
from ..families import SD15, DiffusionCall, Family, family_of_config_class
from ..measure.profiler import PeakMemory, active_run
from ..measure.record import record

RECORDS_KEY = "sdopt_optimizations"
DEFAULT = "default"
VAE_METHODS = ("decode", "encode", "decode_tiled", "encode_tiled")
_KEPT_PROMPTS = 16


# --- keyed wrappers and records on models ----------------------------------------------------------


def comfy_attention():
    from comfy.ldm.modules import attention

    return attention


def free_for_work(device: torch.device) -> int:
    """Bytes a node may use on ``device`` now, as ComfyUI plans: what the device can still allocate,
    less the VRAM ComfyUI keeps for other applications (``--reserve-vram``) on a GPU."""
    from comfy import model_management

    from ..optim.tiled_vae import free_memory

    free = free_memory(device)
    reserved = getattr(model_management, "extra_reserved_memory", None)
    if torch.device(device).type == "cpu" or not callable(reserved):
        return free
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


def set_wrappers(model, key: str, wrappers: dict[str, Callable]) -> None:
    """Make ``wrappers`` ({WrappersMP attribute name: fn}) the only ones of ``key`` on ``model``."""
    kinds = wrapper_types()
    for name in dir(kinds):
        if name.isupper():
            model.remove_wrappers_with_key(getattr(kinds, name), key)
    for name, fn in wrappers.items():
        model.add_wrapper_with_key(getattr(kinds, name), key, fn)


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


def refuse_quantized(model, input_name: str) -> None:
    """A ``UserError`` when the model holds quantized weights, whose scales a converted copy would drop."""
    config = model.model.model_config
    quantized = _static(config, "quant_config") is not None or _static(config, "scaled_fp8") is not None
    quantized = quantized or any(
        type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.model.diffusion_model.parameters()
    )
    if quantized:
        raise UserError(
            f"{input_name}: this model holds quantized weights (scaled fp8, int8, nvfp4...), and a converted copy "
            "would drop their scales; keep it at its default (ComfyUI runs quantized checkpoints natively)"
        )


def _unload_everywhere(module: torch.nn.Module) -> None:
    """Unload every patcher that has ``module`` loaded, so its weights are the unpatched originals."""
    import comfy.model_management as mm

    for loaded in list(mm.current_loaded_models):
        if loaded.model is not None and loaded.model.model is module:
            loaded.model_unload()
            mm.current_loaded_models.remove(loaded)
    if getattr(module, "current_weight_patches_uuid", None) is not None and not _has_dynamic_patcher(module):
        raise RuntimeError("the model still has patched weights after unloading; cannot copy its original weights")


def _has_dynamic_patcher(module) -> bool:
    patcher = getattr(module, "current_patcher", None)
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


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
    _unload_everywhere(source)
    copied = _shallow_module_copy(base)
    copied.diffusion_model = convert(source.diffusion_model)
    copied.current_patcher = None
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
    _unload_everywhere(source)
    duplicate = copy_vae(vae)
    duplicate.first_stage_model = convert(source)
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
            setattr(patched, name, types.MethodType(_filing_records(wrap(name, method.__func__)), patched))
    return patched


def _filing_records(fn: Callable) -> Callable:
    def call(self, *args, **kwargs):
        for entry in self.sdopt_records:
            record(prompt_log().records, **entry)
        return fn(self, *args, **kwargs)

    return call


# --- the per-prompt context ------------------------------------------------------------------------


def _executing_context():
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    return get_executing_context()


def current_prompt_id() -> str:
    """The id of the prompt being executed, from ComfyUI's execution context where it has one."""
    context = _executing_context()
    if context is not None:
        return context.prompt_id
    try:
        from server import PromptServer
    except ImportError:
        return ""
    return str(getattr(getattr(PromptServer, "instance", None), "last_prompt_id", None) or "")


def current_node_id() -> str | None:
    context = _executing_context()
    return context.node_id if context is not None else None


class PromptLog:
    """A prompt's profiled runs and the records of what ran outside sampling (VAE)."""

    def __init__(self):
        self.runs: list[dict] = []
        self.records: list[dict] = []


_prompts: OrderedDict[str, PromptLog] = OrderedDict()


def prompt_log(prompt_id: str | None = None) -> PromptLog:
    prompt_id = current_prompt_id() if prompt_id is None else prompt_id
    if prompt_id not in _prompts:
        _prompts[prompt_id] = PromptLog()
        while len(_prompts) > _KEPT_PROMPTS:
            _prompts.popitem(last=False)
    return _prompts[prompt_id]


HANDLER_NAME = "sdopt.node_timing"


def _progress():
    try:
        from comfy_execution import progress
    except ImportError:
        return None
    return progress


def _timing_handler_class(progress):
    class NodeTimingHandler(progress.ProgressHandler):
        """Records each executed node's wall time and peak memory (cached nodes never start)."""

        def __init__(self, device):
            super().__init__(HANDLER_NAME)
            self.memory = PeakMemory(device)
            self._started: dict[str, float] = {}
            self._class_types: dict[str, str] = {}
            self.nodes: list[dict] = []

        def set_registry(self, registry):
            prompt = registry.dynprompt.original_prompt
            self._class_types = {node_id: node["class_type"] for node_id, node in prompt.items()}

        def start_handler(self, node_id, state=None, prompt_id=None):
            self.memory.reset()
            self._started[node_id] = time.perf_counter()

        def finish_handler(self, node_id, state, prompt_id):
            started = self._started.pop(node_id, None)
            if started is not None:
                seconds = time.perf_counter() - started
                peak = self.memory.read().peak_bytes
                self.nodes.append({"id": str(node_id), "class_type": self._class_types.get(node_id, "?"),
                                   "seconds": seconds, "peak_memory_bytes": peak})

    return NodeTimingHandler


def _timing_handler(prompt_id: str):
    progress = _progress()
    if progress is None:
        return None
    registry = progress.get_progress_state()
    return registry.handlers.get(HANDLER_NAME) if registry.prompt_id == prompt_id else None


def install_node_timer(prompt_id: str, executing_node: str | None = None) -> bool:
    """Time the running prompt's nodes from now on, ``executing_node`` included.

    ComfyUI replaces its progress registry with every prompt, so this runs per prompt: from the
    profiler node, the profiled sampler and the headless runner. False where this ComfyUI cannot
    tell when nodes start and finish.
    """
    progress = _progress()
    if progress is None or progress.get_progress_state().prompt_id != prompt_id:
        return False
    if _timing_handler(prompt_id) is None:
        import comfy.model_management

        handler = _timing_handler_class(progress)(comfy.model_management.get_torch_device())
        progress.add_progress_handler(handler)
        if executing_node is not None:
            handler.start_handler(executing_node)
    return True


def node_timings(prompt_id: str) -> list[dict]:
    """The nodes of this prompt finished so far, in execution order."""
    handler = _timing_handler(prompt_id)
    return list(handler.nodes) if handler is not None else []


def send_to_client(event: str, data: dict) -> None:
    """Send a websocket event to the client that queued the prompt (the browser, or the headless runner)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_sync(event, data, getattr(server, "client_id", None))


def comfyui_version() -> str | None:
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return __version__


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


# --- the fast path: one chain of UNet-forward techniques (step cache, compile, CUDA graph) -----------

FAST_PATH_KEY = "sdopt.fast_path"
_KEPT_OPTIONS = ("optimized_attention_override",)
PLAIN_STEP, FULL_STEP, SHALLOW_STEP = "plain", "full", "shallow"


def _schedule_position(transformer_options: dict) -> float | None:
    """The fraction of the sampling schedule done at this call (from ComfyUI's ``sample_sigmas`` and
    the call's ``sigmas``), or None where the sampler did not say."""
    schedule, sigmas = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if schedule is None or sigmas is None or len(schedule) < 2:
        return None
    done = int((schedule[:-1] > float(sigmas.max()) * (1 + 1e-5)).sum())
    return done / (len(schedule) - 1)


def _diffusion_forward(options: dict, unet, *tensors):
    """The diffusion model's forward on its tensor inputs, in its family's order, with no control."""
    return unet._forward(*tensors, None, dict(options))


def _cached_full_forward(options: dict, branch: int, unet, *tensors):
    """(output, deep features) of the whole UNet, for the step cache to keep."""
    from ..optim.step_cache import full_forward

    return full_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors)


def _cached_shallow_forward(options: dict, branch: int, unet, *tensors_and_deep):
    """The UNet's output from its shallow branch and kept deep features (the last input)."""
    from ..optim.step_cache import shallow_forward

    *tensors, deep = tensors_and_deep
    return shallow_forward(comfy_unet_blocks(unet, dict(options)), branch, *tensors, deep=deep)


class ComfyUNetBlocks:
    """ComfyUI's UNetModel as the step cache's ``UNetBlocks``: the same calls, in the same order,
    with the same transformer options as its ``_forward`` without control or patches (the fast path
    runs those calls eagerly)."""

    def __init__(self, unet, transformer_options: dict):
        from comfy.ldm.modules.diffusionmodules import openaimodel

        self.unet, self.options, self.host = unet, transformer_options, openaimodel
        self.depth = len(unet.input_blocks)

    def _block(self, module, h, emb, context, output_shape=None):
        return self.host.forward_timestep_embed(module, h, emb, context, self.options, output_shape,
                                                num_video_frames=getattr(self.unet, "default_num_video_frames", None))

    def embed(self, x, timesteps, y):
        unet = self.unet
        self.options["original_shape"] = list(x.shape)
        self.options["transformer_index"] = 0
        emb = unet.time_embed(self.host.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
        return emb if unet.num_classes is None else emb + unet.label_emb(y)

    def down(self, index, h, emb, context):
        self.options["block"] = ("input", index)
        return self._block(self.unet.input_blocks[index], h, emb, context)

    def middle(self, h, emb, context):
        self.options["block"] = ("middle", 0)
        return h if self.unet.middle_block is None else self._block(self.unet.middle_block, h, emb, context)

    def up(self, index, h, skip, emb, context, output_shape):
        self.options["block"] = ("output", index)
        return self._block(self.unet.output_blocks[index], torch.cat([h, skip], dim=1), emb, context, output_shape)

    def head(self, h, x):
        h = h.type(x.dtype)
        return self.unet.id_predictor(h) if self.unet.predict_codebook_ids else self.unet.out(h)


def comfy_unet_blocks(unet, transformer_options: dict | None = None) -> ComfyUNetBlocks | None:
    """``unet`` seen as the step cache's blocks, or None where it is not ComfyUI's UNetModel layout
    (as many down as up blocks, a time embedding, an output head)."""
    layout = ("input_blocks", "middle_block", "output_blocks", "time_embed", "out", "model_channels")
    if not all(hasattr(unet, name) for name in layout) or len(unet.input_blocks) != len(unet.output_blocks):
        return None
    return ComfyUNetBlocks(unet, {} if transformer_options is None else transformer_options)


def _bind(call: DiffusionCall, args: tuple, kwargs: dict) -> tuple[tuple, object, object, dict] | None:
    """(tensor inputs in ``call``'s order, control, transformer_options, the other keyword inputs) of
    a call of the diffusion model's forward, which takes ``call.tensor_inputs``, then ``control`` and
    ``transformer_options``; None where it got more positional inputs than that."""
    names = (*call.tensor_inputs, "control", "transformer_options")
    if len(args) > len(names):
        return None
    bound, extra = dict(zip(names, args)), {}
    for name, value in kwargs.items():
        (bound if name in names else extra)[name] = value
    return tuple(bound.get(name) for name in call.tensor_inputs), bound.get("control"), bound.get("transformer_options", {}), extra


def _why_eager(executor, control, transformer_options, kwargs: dict) -> str | None:
    if not isinstance(transformer_options, dict):
        return "inputs that do not fit the family's call (no transformer_options where it expects them)"
    if control is not None:
        return "ControlNet (control) inputs"
    if transformer_options.get("patches") or transformer_options.get("patches_replace"):
        return "transformer patches (IP-Adapter, attention patches...)"
    if any(value is not None for value in kwargs.values()):
        return f"extra model inputs ({', '.join(sorted(kwargs))})"
    if getattr(executor, "idx", 0) + 1 < len(getattr(executor, "wrappers", ())):
        return "another DIFFUSION_MODEL wrapper runs inside this one"
    return None


# The fast path's chain, innermost first. The step cache picks which forward a call runs (the whole
# UNet or its shallow branch); compile then compiles that forward itself (so it comes first of the
# wrappers), and a CUDA graph captures what compile made, so a graph replays compiled kernels and
# never the other way round. The order of the nodes in a workflow does not matter.
STEP_CACHE, COMPILE, GRAPH = "step_cache", "compile", "graph"
CHAIN = (STEP_CACHE, COMPILE, GRAPH)


def _compile_transform(fast_path: "FastPath", unet, fn, call, config):
    """(forward, what holds its stats, sdopt's compile cache entry or None): ``call`` compiled."""
    from ..optim.compile import ArtifactCache, compile_forward, nchw_conv_weight_bytes

    compiled = compile_forward(unet, call, config)
    fast_path.nchw_conv_bytes = nchw_conv_weight_bytes(unet, config)
    if config.mode == "trace":
        return compiled, compiled, None
    cache = ArtifactCache.for_module(unet, config, fast_path.cache_root)
    cache.load()
    return cache.wrap(compiled), compiled, cache  # every call, recompiles too, with torch's compiler caches in sdopt's entry


def _graph_transform(fast_path: "FastPath", unet, fn, call, config):
    """(forward, what holds its stats, None): ``fn`` captured per input signature."""
    from ..optim.cuda_graph import GraphedFunction, module_weights

    graphed = GraphedFunction(fn, module_weights(unet), config)
    return graphed, graphed, None


_WRAPPERS = {COMPILE: _compile_transform, GRAPH: _graph_transform}


class FastPath:
    """The DIFFUSION_MODEL wrapper of SDOptCompile, SDOptCUDAGraph and SDOptStepCache: one per patched clone.

    The diffusion model is called with its tensor inputs only (those ``family``'s call names:
    SDXL's ``y`` too), through ``CHAIN``: the techniques in ``configs`` (keyed by their place in the
    chain), innermost first. With a step cache each call runs either the whole UNet (keeping its
    deep features) or its shallow branch on kept features, as the step cache's schedule says; each
    of the two is compiled and captured on its own. Its state (compiled code, graphs) is shared by
    clones made downstream (e.g. by a LoRA loader); the weight identity check makes those use their
    own weights, and the step cache starts afresh with every sampling run.
    """

    def __init__(self, configs: dict, family: ModelFamily, cache_root=None):
        from ..optim.step_cache import CacheSchedule

        unknown = set(configs) - set(CHAIN)
        if unknown:
            raise ValueError(f"not in the fast path's chain {CHAIN}: {sorted(unknown)}")
        self.configs = {name: configs[name] for name in CHAIN if configs.get(name) is not None}
        self.schedule = CacheSchedule(self.step_cache_config) if self.step_cache_config else None
        self.family = family
        self.cache_root = cache_root
        self.runners: dict[tuple, tuple] = {}
        self.eager_reasons: dict[str, int] = {}
        self.nchw_conv_bytes = 0
        self.cache_saved = None
        self.requested: dict[str, str] = {}
        self.notes: dict[str, Callable[[], str]] = {}  # per node: what else its record says after a run

    compile_config = property(lambda self: self.configs.get(COMPILE))
    graph_config = property(lambda self: self.configs.get(GRAPH))
    step_cache_config = property(lambda self: self.configs.get(STEP_CACHE))

    def with_config(self, name: str, config) -> "FastPath":
        """A new fast path (fresh compiled code, graphs and step cache) with ``name``'s config replaced."""
        new = FastPath({**self.configs, name: config}, self.family, self.cache_root)
        new.requested = dict(self.requested)
        new.notes = dict(self.notes)
        return new

    def _runner(self, unet, options: dict, kind: str = PLAIN_STEP):
        """(fn, {chain name: what holds its stats}, compile cache entry or None) of one kind of call:
        the plain forward, or the step cache's full or shallow one; each kind compiles and captures
        its own code."""
        key = (id(unet), tuple(id(options.get(name)) for name in _KEPT_OPTIONS), kind)
        if key in self.runners and self.runners[key][0] is unet:
            return self.runners[key][1:]
        if kind == PLAIN_STEP:
            call = functools.partial(_diffusion_forward, options)
        else:
            forward = _cached_full_forward if kind == FULL_STEP else _cached_shallow_forward
            call = functools.partial(forward, options, self.step_cache_config.branch)
        fn, parts, cache = functools.partial(call, unet), {}, None
        for name, config in self.configs.items():
            if name in _WRAPPERS:
                fn, parts[name], entry = _WRAPPERS[name](self, unet, fn, call, config)
                cache = entry or cache
        self.runners[key] = (unet, fn, parts, cache)
        return fn, parts, cache

    def __call__(self, executor, *args, **kwargs):
        bound = _bind(self.family.call, args, kwargs)
        if bound is None:
            reason = f"more positional inputs than {self.family.described.title}'s call takes"
        else:
            tensors, control, transformer_options, extra = bound
            reason = _why_eager(executor, control, transformer_options, extra)
        if reason:
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
            return executor(*args, **kwargs)
        options = {name: transformer_options[name] for name in _KEPT_OPTIONS if name in transformer_options}
        if self.schedule is None:
            return self._run(executor.class_obj, options, PLAIN_STEP, tensors)
        key = tuple(transformer_options.get("cond_or_uncond") or ())
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)
        deep = self.schedule.decide(key, shapes, _schedule_position(transformer_options) if self.schedule.config.bounded else None)
        if deep is not None:
            return self._run(executor.class_obj, options, SHALLOW_STEP, (*tensors, deep))
        output, deep = self._run(executor.class_obj, options, FULL_STEP, tensors)
        self.schedule.keep(key, shapes, deep)
        return output

    def _run(self, unet, options: dict, kind: str, tensors: tuple):
        fn, parts, cache = self._runner(unet, options, kind)
        before = _warmup_counters(parts)
        with _malloc_graph_paused():
            output = fn(*tensors)
        compilations, compile_s, captures, capture_s = (now - then for now, then in zip(_warmup_counters(parts), before))
        if cache is not None and compilations:
            self.cache_saved = cache.save()
        run = active_run()
        if run is not None and compilations:
            run.warm_up("compile", compile_s)
        if run is not None and captures:
            # the capture's warm-up runs call the compiled forward: a compile in this call lies
            # inside the capture's time, and is counted once, above
            run.warm_up("capture", capture_s - compile_s)
        return output

    def stats(self) -> tuple[list, list]:
        """(compile stats, graph stats), one per runner that has them."""
        parts = [entry[2] for entry in self.runners.values()]
        return [p[COMPILE].stats for p in parts if COMPILE in p], [p[GRAPH].stats for p in parts if GRAPH in p]


def _some_reasons(counts: dict[str, int]) -> str:
    """The reasons some calls ran eagerly, with how many: one line."""
    return ", ".join(f"{reason} ({n}x)" for reason, n in counts.items())


def _warmup_counters(parts: dict) -> tuple[int, float, int, float]:
    """(compilations, compile seconds, captures, capture seconds) of a runner so far: a call that
    raises them is a warm-up step for the profiler."""
    compiled, graphed = parts.get(COMPILE), parts.get(GRAPH)
    compiles = (compiled.stats.compilations, compiled.stats.compile_seconds) if compiled else (0, 0.0)
    return compiles + ((graphed.stats.captures, graphed.stats.capture_seconds) if graphed else (0, 0.0))


@contextmanager
def _malloc_graph_paused():
    """ComfyUI 0.38's memory compiler records allocations into malloc graphs; capture must stay out."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    pause = getattr(prefetch, "pause_malloc_graph", None)
    with pause() if pause else nullcontext():
        yield


def fast_path_of(model) -> FastPath | None:
    for fn in model.get_wrappers(wrapper_types().DIFFUSION_MODEL, FAST_PATH_KEY):
        if isinstance(fn, FastPath):
            return fn
    return None


def dynamic_vram_probe() -> Callable[[], int] | None:
    """ComfyUI 0.38's dynamic VRAM maps weights through comfy-aimdo (cuMemMap), past PyTorch's
    allocator: its total usage, where that is on; else None."""
    memory_management = sys.modules.get("comfy.memory_management")
    if not getattr(memory_management, "aimdo_enabled", False):
        return None
    try:
        from comfy_aimdo import control
    except ImportError:
        return None
    return getattr(control, "get_total_vram_usage", None)


def non_dynamic_clone(model):
    """A clone that ComfyUI 0.38's dynamic VRAM does not stream (graphs and compiled code need
    fixed weight addresses), as ComfyUI's own TorchCompileModel does; and which path ran."""
    if getattr(model, "is_dynamic", lambda: False)() and hasattr(model, "get_non_dynamic_delegate"):
        return model.get_non_dynamic_delegate(), "dynamic VRAM patcher: running on its non-dynamic delegate"
    return model.clone(), ""


def install_fast_path(model, fast_path: FastPath) -> None:
    """Put ``fast_path`` on ``model`` and file its compile and graph figures after each sampling run."""

    requested = fast_path.requested

    def report_after_sampling(executor, *args, **kwargs):
        if fast_path.schedule is not None:
            fast_path.schedule.reset()
        try:
            return executor(*args, **kwargs)
        finally:
            compile_stats, graph_stats = fast_path.stats()
            eager = "; ".join(filter(None, [*(f"eager for {reason} ({n}x)" for reason, n in fast_path.eager_reasons.items()), fast_path.family.unknown_note]))
            eager_short = f"eager for {_some_reasons(fast_path.eager_reasons)}" if fast_path.eager_reasons else ""
            if "SDOptCompile" in requested and fast_path.compile_config:
                warm = "; ".join(dict.fromkeys(filter(None, (cache.note() for *_, cache in fast_path.runners.values() if cache))))
                layout = (
                    f"{fast_path.nchw_conv_bytes / 2**20:,.0f} MiB of conv weights are stored NCHW, so inductor copies them to "
                    "channels-last on every step: sdopt Precision's channels_last stores them that way once"
                ) if fast_path.nchw_conv_bytes else ""
                details = [line for s in compile_stats for line in s.details()]
                note = "; ".join(filter(None, [fast_path.notes.get("SDOptCompile", str)(), *details, warm,
                                               f"cache: {fast_path.cache_saved}" if fast_path.cache_saved else "", layout, eager]))
                active = f"{fast_path.compile_config.settings()}: " + " | ".join(s.summary() for s in compile_stats)
                short = "; ".join(dict.fromkeys(filter(None, [*(s.shortfall() for s in compile_stats), eager_short])))
                record_in_run("SDOptCompile", requested["SDOptCompile"], active, note, short)
            if "SDOptStepCache" in requested and fast_path.schedule is not None:
                cache_stats = fast_path.schedule.stats
                note = "; ".join(filter(None, [fast_path.notes.get("SDOptStepCache", str)(), eager]))
                short = "; ".join(filter(None, [cache_stats.shortfall(), eager_short]))
                record_in_run("SDOptStepCache", requested["SDOptStepCache"], f"{fast_path.step_cache_config.settings()}: {cache_stats.summary()}",
                              note, short)
            if "SDOptCUDAGraph" in requested and fast_path.graph_config:
                active = "CUDA graph: " + " | ".join(s.summary() for s in graph_stats)
                record_in_run("SDOptCUDAGraph", requested["SDOptCUDAGraph"], active, eager, eager_short)

    # SAMPLER_SAMPLE runs inside every OUTER_SAMPLE wrapper, so the profiler's run is open here
    set_wrappers(model, FAST_PATH_KEY, {"DIFFUSION_MODEL": fast_path, "SAMPLER_SAMPLE": report_after_sampling})


def fast_path_clone(model, node: str, requested: str, problem: Unavailable | None, on_unavailable: str, name: str, config):
    """(clone, note) for SDOptCompile, SDOptCUDAGraph and SDOptStepCache: the clone's fast path gets
    ``config`` at ``name``'s place in ``CHAIN`` (the rest of the chain as the input model had it). Where ``problem``
    says the technique cannot run: ``fall_back_or_raise``, then the clone as it is, recorded as
    eager, and a None note."""
    unavailable = fall_back_or_raise(on_unavailable, problem, "run eager")
    m, path_note = non_dynamic_clone(model)
    if unavailable:
        record_model(m, node, requested, "eager", f"{unavailable}; running eager", f"runs eager: {unavailable}")
        return m, None
    current = fast_path_of(m)
    fast_path = current.with_config(name, config) if current else FastPath({name: config}, model_family(m))
    fast_path.requested[node] = requested
    install_fast_path(m, fast_path)
    return m, "; ".join(filter(None, [path_note, fast_path.family.unknown_note]))
