"""nodes.glue and the node-side wrappers against fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import copy
import gc
import re
import sys
import types
import uuid

import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun, active_run
from sdopt.nodes import attention as attention_node
from sdopt.nodes import glue
from sdopt.nodes import profiler as profiler_node
from sdopt.nodes import prompt_context
from sdopt.optim.attention import AttentionConfig, backend_function, build_attention, naive_attention
from sdopt.optim.precision import converted_copy

from .comfy_fakes import (PROMPT, SD15, SDXL, SSD1B, ApplyModelExecutor, AuraFlow, FastPatcher, TinyXLUNet, WrappedPatcher, base_model,
                          install, keyed_wrappers, sdxl_vector, unet_inputs)

pytestmark = pytest.mark.usefixtures("no_comfyui")


# --- a. rebased: a patcher of another module with the same recipe ------------------------------------


class OverridePatcher:
    """ComfyUI 0.38's clone signature: ``model_override=(model, backups)`` builds the clone on ``model``
    with those backups; ``get_clone_model_override`` names the backups a clone shares."""

    def __init__(self, model, size=1234):
        self.model = model
        self.size = size  # ComfyUI's clone passes the original's model_size() on
        self.backup, self.backup_buffers, self.object_patches_backup, self.pinned = {"w": 1}, {"b": 2}, {"o": 3}, {"k"}
        self.patches = {"w": [("lora",)]}
        self.model_options = {"transformer_options": {"x": 1}}
        self.cached_patcher_init = ("load_checkpoint", ("sd15.safetensors",))
        self.hook_backup, self.cached_hook_patches, self.clone_base_uuid = {"w": "hooked"}, {"group": {"w": "cached"}}, uuid.uuid4()
        self.clone_calls = []

    def get_clone_model_override(self):
        return self.model, (self.backup, self.backup_buffers, self.object_patches_backup, self.pinned)

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        self.clone_calls.append({"disable_dynamic": disable_dynamic, "model_override": model_override, "force_deepcopy": force_deepcopy})
        model, backups = model_override if model_override is not None else self.get_clone_model_override()
        clone = OverridePatcher(model, self.size)
        clone.backup, clone.backup_buffers, clone.object_patches_backup, clone.pinned = backups
        clone.patches = {k: v[:] for k, v in self.patches.items()}
        clone.model_options = copy.deepcopy(self.model_options)
        clone.cached_patcher_init = self.cached_patcher_init
        clone.hook_backup, clone.clone_base_uuid = self.hook_backup, self.clone_base_uuid  # by reference, as ComfyUI's clone
        clone.cached_hook_patches = {group: dict(cached) for group, cached in self.cached_hook_patches.items()}
        clone.parent = self
        return clone


class OverridePatcher033(OverridePatcher):
    """A clone with ``model_override`` but no ``disable_dynamic``."""

    def clone(self, model_override=None):
        return super().clone(model_override=model_override)


def test_rebased_asks_comfyui_for_a_non_dynamic_clone_with_fresh_backups():
    original, module = nn.Linear(2, 2), nn.Linear(2, 2)
    patcher = OverridePatcher(original)
    shared = patcher.get_clone_model_override()[1]
    rebased = glue.rebased(patcher, module)
    (call,) = patcher.clone_calls
    assert call["disable_dynamic"] is True and call["force_deepcopy"] is False
    model, backups = call["model_override"]
    assert model is module
    assert [type(b) for b in backups] == [dict, dict, dict, set]
    assert all(len(b) == 0 for b in backups)
    assert all(fresh is not old for fresh, old in zip(backups, shared)), "fresh containers, never the original's"
    assert rebased.model is module and rebased.cached_patcher_init is None
    assert rebased.size == 0 and patcher.size == 1234, "the copy's size is measured, not the original's"
    assert patcher.cached_patcher_init == ("load_checkpoint", ("sd15.safetensors",)), "the input patcher keeps its factory"
    assert rebased.patches == patcher.patches and rebased.model_options == patcher.model_options
    assert rebased.hook_backup == {} and rebased.cached_hook_patches == {}, "hook LoRA backups are of the input's weights"
    assert rebased.clone_base_uuid != patcher.clone_base_uuid, "multi-GPU copies must not take it for the input's weights"
    assert patcher.hook_backup == {"w": "hooked"} and patcher.cached_hook_patches == {"group": {"w": "cached"}}
    assert patcher.backup == {"w": 1} and patcher.pinned == {"k"}


def test_rebased_without_disable_dynamic():
    patcher = OverridePatcher033(nn.Linear(2, 2))
    module = nn.Linear(2, 2)
    rebased = glue.rebased(patcher, module)
    (call,) = patcher.clone_calls
    assert call["disable_dynamic"] is False and call["model_override"][0] is module
    assert rebased.model is module and rebased.cached_patcher_init is None


class LegacyPatcher:
    """ComfyUI 0.3.x's ModelPatcher, as far as ``rebased`` reads it: ``clone()`` takes no arguments and
    shares the model-tied fields (backups, patches_uuid, pinned) with its clones."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.size = size
        self.model = model
        self.patches = {}
        self.backup = {}
        self.object_patches = {}
        self.object_patches_backup = {}
        self.model_options = {"transformer_options": {}}
        self.load_device = load_device
        self.offload_device = offload_device
        self.weight_inplace_update = weight_inplace_update
        self.patches_uuid = uuid.uuid4()
        self.parent = None
        self.pinned = set()
        self.callbacks = {}
        self.wrappers = {}
        self.is_injected = False
        self.hook_backup = {}

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device, 123, weight_inplace_update=self.weight_inplace_update)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.object_patches = self.object_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        n.backup = self.backup
        n.object_patches_backup = self.object_patches_backup
        n.parent = self
        n.pinned = self.pinned
        n.callbacks = {k: {k1: c.copy() for k1, c in v.items()} for k, v in self.callbacks.items()}
        n.wrappers = {k: {k1: w.copy() for k1, w in v.items()} for k, v in self.wrappers.items()}
        n.is_injected = self.is_injected
        n.hook_backup = self.hook_backup
        return n


class LegacySubclass(LegacyPatcher):
    pass


def test_rebased_on_legacy_comfyui_builds_a_new_patcher_with_the_recipe_only():
    original, module = nn.Linear(2, 2), nn.Linear(2, 2)
    patcher = LegacySubclass(original, "cuda:0", "cpu", weight_inplace_update=True)
    wrapper = object()
    patcher.patches = {"weight": [("lora", 1.0)]}
    patcher.object_patches = {"manual_cast_dtype": torch.float16}
    patcher.model_options = {"transformer_options": {"k": "v"}, "sdopt_optimizations": [{"node": "N"}]}
    patcher.wrappers = {"outer_sample": {"key": [wrapper]}}
    patcher.callbacks = {"on_clone": {"key": [print]}}
    patcher.backup = {"weight": "backed-up"}
    patcher.object_patches_backup = {"x": 1}
    patcher.pinned = {"weight"}
    patcher.hook_backup = {"h": 1}
    patcher.is_injected = True

    fresh = glue.rebased(patcher, module)
    assert type(fresh) is LegacySubclass and fresh is not patcher
    assert fresh.model is module and patcher.model is original
    assert (fresh.load_device, fresh.offload_device, fresh.weight_inplace_update) == ("cuda:0", "cpu", True)
    # The recipe, as copies.
    assert fresh.patches == patcher.patches and fresh.patches is not patcher.patches
    assert fresh.object_patches == patcher.object_patches
    assert fresh.model_options == patcher.model_options and fresh.model_options is not patcher.model_options
    assert fresh.wrappers == {"outer_sample": {"key": [wrapper]}} and fresh.wrappers is not patcher.wrappers
    assert fresh.callbacks == patcher.callbacks
    # Nothing tied to the original model.
    assert fresh.backup == {} and fresh.backup is not patcher.backup
    assert fresh.object_patches_backup == {} and fresh.hook_backup == {}
    assert fresh.pinned == set() and fresh.pinned is not patcher.pinned
    assert fresh.patches_uuid != patcher.patches_uuid
    assert fresh.parent is None and fresh.size == 0 and fresh.is_injected is False
    fresh.model_options["transformer_options"]["k"] = "changed"
    assert patcher.model_options["transformer_options"]["k"] == "v"


# --- b. is_quantized, refuse_quantized ----------------------------------------------------------------


class Config033:
    """ComfyUI 0.33's model config logs and answers None for any missing attribute."""

    asked: list

    def __init__(self):
        self.asked = []

    def __getattr__(self, name):
        self.__dict__.setdefault("asked", []).append(name)
        return None


def _model(config, diffusion_model=None):
    base = types.SimpleNamespace(model_config=config, diffusion_model=diffusion_model or nn.Linear(2, 2))
    return types.SimpleNamespace(model=base)


class MixedOps:
    quant_config = {"mixed_ops": True}


class ScaledFp8:
    scaled_fp8 = torch.float8_e4m3fn


class Plain:
    quant_config = None
    scaled_fp8 = None


class QuantizedTensor(torch.Tensor):
    pass


@pytest.mark.parametrize("config", [MixedOps(), ScaledFp8()], ids=["quant_config", "scaled_fp8"])
def test_refuse_quantized_configs(config):
    assert glue.is_quantized(_model(config))
    with pytest.raises(UserError, match=r"^weight_dtype: this model holds quantized weights.*; set it to default \("):
        glue.refuse_quantized(_model(config), "weight_dtype", "set it to default")


def test_refuse_quantized_instance_attribute():
    config = Plain()
    config.scaled_fp8 = torch.float8_e4m3fn  # as ComfyUI's model detection sets it
    with pytest.raises(UserError, match="^dtype: "):
        glue.refuse_quantized(_model(config), "dtype", "set it to default")


def test_refuse_quantized_tensor_subclass_parameters():
    module = nn.Linear(2, 2)
    module.weight = nn.Parameter(torch.randn(2, 2).as_subclass(QuantizedTensor), requires_grad=False)
    assert type(module.weight) is QuantizedTensor, "Parameter keeps a tensor subclass's type"
    with pytest.raises(UserError, match="weight_dtype"):
        glue.refuse_quantized(_model(Plain(), module), "weight_dtype", "set it to default")


def test_plain_models_pass_without_calling_getattr():
    config = Config033()
    assert config.anything is None and config.asked == ["anything"], "the fake behaves like 0.33's"
    config.asked.clear()
    assert not glue.is_quantized(_model(config)) and not glue.is_quantized(_model(Plain()))
    glue.refuse_quantized(_model(config), "weight_dtype", "set it to default")
    assert config.asked == [], "quantization is read without __getattr__"


# --- c. _shallow_module_copy --------------------------------------------------------------------------


def test_shallow_module_copy_has_its_own_tables():
    original = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    original.register_buffer("scale", torch.ones(1))
    original.tag = "shared"
    child, weight = original[0], original[0].weight
    duplicate = glue._shallow_module_copy(original)
    assert type(duplicate) is nn.Sequential and duplicate.tag == "shared"
    assert duplicate[0] is child, "children are shared until replaced"
    duplicate[0] = nn.Identity()
    duplicate.scale = torch.zeros(1)
    duplicate.extra = nn.Parameter(torch.ones(1))
    assert original[0] is child and original[0].weight is weight
    assert torch.equal(original.scale, torch.ones(1)) and not hasattr(original, "extra")
    assert isinstance(duplicate[0], nn.Identity)


# --- d. private_copy -----------------------------------------------------------------------------------


class BaseModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.diffusion_model = nn.Sequential(nn.Conv2d(4, 4, 3), nn.Linear(4, 4))
        self.model_config = Plain()
        self.current_weight_patches_uuid = None
        self.current_patcher = "the input's patcher"


class LoadedModel:
    def __init__(self, patcher):
        self.model = patcher
        self.unloaded = 0

    def model_unload(self):
        self.unloaded += 1
        return True


@pytest.fixture
def model_management(monkeypatch):
    archived = []
    mm = install(monkeypatch, "comfy.model_management", current_loaded_models=[], archive_model_dtypes=archived.append)
    mm.archived = archived
    return mm


def test_private_copy_converts_a_copy_and_leaves_the_input(model_management):
    base = BaseModel()
    patcher = OverridePatcher(base)
    other = LoadedModel(OverridePatcher(BaseModel()))
    mine, dead = LoadedModel(patcher.clone()), LoadedModel(None)
    model_management.current_loaded_models[:] = [other, mine, dead]
    original_unet = base.diffusion_model
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    converted = []

    def convert(module):
        converted.append(module)
        return converted_copy(module, torch.float16)

    copy_patcher = glue.private_copy(patcher, convert)
    assert converted == [original_unet]
    assert mine.unloaded == 1 and other.unloaded == 0 and dead.unloaded == 0
    assert model_management.current_loaded_models == [other, dead]
    copied = copy_patcher.model
    assert isinstance(copied, BaseModel) and copied is not base
    assert copied.model_config is base.model_config, "the rest of the BaseModel is shared"
    assert copied.diffusion_model is not original_unet
    assert {p.dtype for p in copied.diffusion_model.parameters()} == {torch.float16}
    assert base.diffusion_model is original_unet and base.current_patcher == "the input's patcher"
    assert all(torch.equal(v, weights[k]) and v.dtype == torch.float32 for k, v in base.state_dict().items())
    assert copied.current_patcher is None
    assert model_management.archived == [copied.diffusion_model]
    assert patcher.model is base and copy_patcher.cached_patcher_init is None


def test_private_copy_on_legacy_comfyui(monkeypatch):
    install(monkeypatch, "comfy.model_management", current_loaded_models=[])  # no archive_model_dtypes before 0.38
    base = BaseModel()
    patcher = LegacyPatcher(base, "cpu", "cpu")
    patcher.model_options["sdopt_optimizations"] = [{"node": "N", "requested": "a", "active": "b", "note": ""}]
    copy_patcher = glue.private_copy(patcher, lambda module: converted_copy(module, torch.bfloat16))
    assert copy_patcher.model is not base and copy_patcher.model.diffusion_model[1].weight.dtype == torch.bfloat16
    assert copy_patcher.model_options == patcher.model_options
    assert base.diffusion_model[1].weight.dtype == torch.float32


def test_private_copy_refuses_weights_still_patched(model_management):
    base = BaseModel()
    base.current_weight_patches_uuid = uuid.uuid4()  # an unload that did not restore the weights
    with pytest.raises(RuntimeError, match="still has patched weights"):
        glue.private_copy(OverridePatcher(base), lambda module: module)


class DynamicPatcher(OverridePatcher):
    """0.38's ModelPatcherDynamic: it patches each layer's weights as the layer streams, and its
    unload leaves ``current_weight_patches_uuid`` set."""

    def is_dynamic(self):
        return True


class Slot:
    """A native handle of comfy-aimdo's, which deepcopy cannot copy."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy an aimdo handle")


def dynamically_loaded(base):
    """``base`` as 0.38's dynamic VRAM leaves it between prompts: no current patcher (ComfyUI sets it only
    while a sampler runs), the last load's patch uuid, and aimdo's state on the model and its layers."""
    base.current_patcher = None
    base.current_weight_patches_uuid = uuid.uuid4()
    base.dynamic_vbars, base.dynamic_pins, base.dynamic_patchers = {"cuda:0": Slot()}, [Slot()], [Slot()]
    for layer in base.diffusion_model:
        layer._v, layer._v_signature, layer._pin_state = (Slot(), 0, 64), Slot(), {"weights": Slot()}
        layer.weight_lowvram_function, layer.bias_lowvram_function, layer.comfy_cast_weights = Slot(), None, True
        # what a layer's first forward leaves: views over its VRAM window and pinned host memory
        layer._v_weight, layer._v_bias, layer._prefetch = Slot(), Slot(), {"signature": Slot(), "xfer_dest": Slot()}
        layer._pins, layer._v_block_faulted = {"weights": {"pin": Slot(), "registered": True}}, Slot()
    return base


def _convert(module):
    return converted_copy(module, torch.bfloat16, leave_out=glue.DYNAMIC_VRAM_LAYER_STATE)


def test_private_copy_of_a_dynamically_loaded_model_takes_none_of_its_state(model_management):
    base = dynamically_loaded(BaseModel())
    patcher = DynamicPatcher(base)
    model_management.current_loaded_models[:] = [LoadedModel(patcher.clone())]
    vbars, layer_slot = base.dynamic_vbars, base.diffusion_model[0]._v
    copied = glue.private_copy(patcher, _convert).model
    assert model_management.current_loaded_models == []
    assert copied.current_weight_patches_uuid is None and base.current_weight_patches_uuid is not None, "a fresh model's state"
    assert copied.diffusion_model[1].weight.dtype == torch.bfloat16
    assert not any(hasattr(copied, name) for name in glue.DYNAMIC_VRAM_MODEL_STATE), "never the original's VRAM or pins"
    assert not any(hasattr(layer, name) for layer in copied.diffusion_model for name in glue.DYNAMIC_VRAM_LAYER_STATE), (
        "a staging slot on a layer alone routes its forward through aimdo")
    assert base.dynamic_vbars is vbars and base.diffusion_model[0]._v is layer_slot, "the input keeps its state"


@pytest.mark.parametrize("known_by", ["input", "loaded", "model state"])
def test_private_copy_knows_a_dynamically_managed_model_by_any_sign(model_management, known_by):
    base = BaseModel()
    base.current_patcher, base.current_weight_patches_uuid = None, uuid.uuid4()
    given = DynamicPatcher(base) if known_by == "input" else OverridePatcher(base)
    if known_by == "loaded":
        model_management.current_loaded_models[:] = [LoadedModel(DynamicPatcher(base))]
    if known_by == "model state":  # an earlier sdopt copy's input: the original, long since unloaded
        base.dynamic_vbars = {}
    assert glue.private_copy(given, _convert).model is not base


def test_private_vae_copy(model_management, prompts):
    vae = FakeVAE()
    vae.first_stage_model = nn.Conv2d(3, 3, 1)
    vae.patcher = OverridePatcher(vae.first_stage_model)
    vae.sdopt_records = [{"node": "N", "requested": "a", "active": "b", "note": ""}]
    model_management.current_loaded_models[:] = [LoadedModel(vae.patcher)]
    original = vae.first_stage_model
    duplicate = glue.private_vae_copy(vae, lambda module: converted_copy(module, torch.bfloat16))
    assert model_management.current_loaded_models == []
    assert vae.first_stage_model is original and original.weight.dtype == torch.float32
    assert duplicate.first_stage_model.weight.dtype == torch.bfloat16
    assert duplicate.patcher.model is duplicate.first_stage_model and vae.patcher.model is original
    assert model_management.archived == [duplicate.first_stage_model]
    assert duplicate.sdopt_records == vae.sdopt_records and duplicate.sdopt_records is not vae.sdopt_records



def test_private_vae_copy_of_a_dynamically_loaded_vae(model_management, prompts):
    vae = FakeVAE()
    vae.first_stage_model = nn.Conv2d(3, 3, 1)
    vae.first_stage_model.current_weight_patches_uuid = uuid.uuid4()  # a VAE never has a current_patcher
    vae.first_stage_model._v, vae.first_stage_model._v_weight, vae.first_stage_model._prefetch = Slot(), Slot(), {"x": Slot()}
    vae.patcher = DynamicPatcher(vae.first_stage_model)
    duplicate = glue.private_vae_copy(vae, _convert)
    copied = duplicate.first_stage_model
    assert copied.weight.dtype == torch.bfloat16
    assert not any(hasattr(copied, name) for name in ("_v", "_v_weight", "_prefetch"))
    assert copied.current_weight_patches_uuid is None, "a fresh VAE's state, as the UNet copy's"
    assert isinstance(vae.first_stage_model._v, Slot) and vae.first_stage_model.current_weight_patches_uuid is not None


def _recording(converted: list, dtype):
    def convert(module):
        converted.append(module)
        return converted_copy(module, dtype)

    return convert


def test_a_chained_private_copy_converts_the_weights_before_any_sdopt_copy(model_management):
    base = BaseModel()
    original_unet = base.diffusion_model
    converted, notes = [], []
    first = glue.private_copy(OverridePatcher(base), _recording(converted, torch.bfloat16))
    second = glue.private_copy(first, _recording(converted, torch.float32), notes)
    third = glue.private_copy(second, _recording(converted, torch.float16), notes)
    assert converted == [original_unet] * 3, "never the bf16 copy, never the fp32 copy of it"
    assert glue.copy_source(third.model) == (base, "") and glue.copy_source(base) == (base, "")
    assert all(torch.equal(a, b) for a, b in zip(second.model.diffusion_model.parameters(), original_unet.parameters())), \
        "bf16 then fp32 holds the original fp32 weights, bit for bit"
    assert first.model.diffusion_model[1].weight.dtype == torch.bfloat16, "the first copy is left as it is"
    assert notes == []


def test_a_chained_copy_unloads_the_source_it_reads(model_management):
    base = BaseModel()
    first = glue.private_copy(OverridePatcher(base), lambda module: converted_copy(module, torch.bfloat16))
    source_loaded, copy_loaded = LoadedModel(OverridePatcher(base)), LoadedModel(first)
    model_management.current_loaded_models[:] = [source_loaded, copy_loaded]
    glue.private_copy(first, lambda module: converted_copy(module, torch.float32))
    assert source_loaded.unloaded == 1, "the weights read must be the unpatched originals"
    assert model_management.current_loaded_models == [copy_loaded]


def test_a_copy_whose_source_was_freed_converts_its_input_and_says_so(model_management):
    base = BaseModel()
    first = glue.private_copy(OverridePatcher(base), lambda module: converted_copy(module, torch.bfloat16))
    first.parent = None  # as on ComfyUI before 0.33, whose copy's patcher keeps no reference to its input
    del base
    gc.collect()
    converted, notes = [], []
    second = glue.private_copy(first, _recording(converted, torch.float32), notes)
    assert converted == [first.model.diffusion_model]
    assert notes == [glue.SOURCE_FREED]
    assert glue.copy_source(second.model)[0] is first.model


def test_a_chained_vae_copy_converts_the_weights_before_any_sdopt_copy(model_management, prompts):
    vae = FakeVAE()
    vae.first_stage_model = nn.Conv2d(3, 3, 1)
    vae.patcher = OverridePatcher(vae.first_stage_model)
    original = vae.first_stage_model
    converted = []
    first = glue.private_vae_copy(vae, _recording(converted, torch.bfloat16))
    second = glue.private_vae_copy(first, _recording(converted, torch.float32))
    assert converted == [original, original]
    assert torch.equal(second.first_stage_model.weight, original.weight)
    assert first.first_stage_model.weight.dtype == torch.bfloat16


# --- e. keyed wrappers -----------------------------------------------------------------------------------

def test_patched_clone_replaces_its_own_key_and_keeps_others(patcher_extension):
    def f1(executor, *a, **k): ...
    def f2(executor, *a, **k): ...
    def g1(executor, *a, **k): ...
    def other(executor, *a, **k): ...

    model = WrappedPatcher()
    model.add_wrapper_with_key("outer_sample", "someone_else", other)
    model.add_wrapper_with_key("apply_model", "someone_else", other)
    first = glue.patched_clone(model, "SDOptProfiler", {"OUTER_SAMPLE": f1, "SAMPLER_SAMPLE": f2})
    assert keyed_wrappers(first, "SDOptProfiler") == {"outer_sample": [f1], "sampler_sample": [f2]}
    second = glue.patched_clone(first, "SDOptProfiler", {"OUTER_SAMPLE": g1})
    assert keyed_wrappers(second, "SDOptProfiler") == {"outer_sample": [g1]}, "the second call's wrappers only"
    assert keyed_wrappers(second, "someone_else") == {"outer_sample": [other], "apply_model": [other]}
    assert keyed_wrappers(first, "SDOptProfiler") == {"outer_sample": [f1], "sampler_sample": [f2]}, "the input clone is unchanged"
    assert keyed_wrappers(model, "SDOptProfiler") == {}
    third = glue.patched_clone(second, "SDOptProfiler")
    assert keyed_wrappers(third, "SDOptProfiler") == {} and keyed_wrappers(third, "someone_else") == keyed_wrappers(model, "someone_else")


def test_make_outermost_moves_only_the_order_of_one_kind(patcher_extension):
    model = WrappedPatcher()
    model.add_wrapper_with_key("apply_model", "someone_else", print)
    model.add_wrapper_with_key("outer_sample", "someone_else", print)
    glue.set_wrappers(model, "K", {"APPLY_MODEL": repr, "OUTER_SAMPLE": repr})
    glue.make_outermost(model, "K", "APPLY_MODEL")
    assert list(model.wrappers["apply_model"]) == ["K", "someone_else"], "ComfyUI runs the first key outermost"
    assert list(model.wrappers["outer_sample"])[:2] == ["someone_else", "K"]
    assert model.wrappers["apply_model"]["K"] == [repr] and model.wrappers["apply_model"]["someone_else"] == [print]
    glue.make_outermost(model, "absent", "APPLY_MODEL")
    assert list(model.wrappers["apply_model"]) == ["K", "someone_else"]


def test_each_part_of_a_split_batch_describes_its_own_rows():
    """cfg with two images: ComfyUI's lists hold one entry per conditioning, two rows each."""
    options = {"cond_or_uncond": [0, 1], "uuids": ["c", "u"], "sigmas": "sliced elsewhere"}
    parts = []
    for start in range(4):
        part = (dict(options), "t")
        glue.label_batch_rows(slice(start, start + 1), 4, part, {})
        parts.append(part[0])
    assert [(p["cond_or_uncond"], p["uuids"], p[glue.BATCH_ROWS]) for p in parts] == [
        ([0], ["c"], (0, 1)), ([0], ["c"], (1, 2)), ([1], ["u"], (2, 3)), ([1], ["u"], (3, 4))]
    assert len({glue.call_key(p) for p in parts}) == 4, "equal shapes, so the step caches tell the parts apart by their rows"
    assert glue.call_key(options) == ((0, 1), None) and options["cond_or_uncond"] == [0, 1], "the whole call's options are left alone"
    pair = {"transformer_options": {"cond_or_uncond": [0, 1], "uuids": ["c", "u"]}}
    glue.label_batch_rows(slice(0, 2), 4, (), pair)
    assert pair["transformer_options"]["cond_or_uncond"] == [0] and pair["transformer_options"][glue.BATCH_ROWS] == (0, 2)
    odd = {"cond_or_uncond": [0, 1], "uuids": ["c", "u"]}
    glue.label_batch_rows(slice(0, 1), 3, (odd,), {})
    assert odd == {"cond_or_uncond": [0, 1], "uuids": ["c", "u"], glue.BATCH_ROWS: (0, 1)}, "rows that fit no entry: only the rows"


def test_set_wrappers_in_place_twice(patcher_extension):
    model = WrappedPatcher()
    glue.set_wrappers(model, "K", {"APPLY_MODEL": print})
    glue.set_wrappers(model, "K", {"APPLY_MODEL": repr, "DIFFUSION_MODEL": repr})
    assert keyed_wrappers(model, "K") == {"apply_model": [repr], "diffusion_model": [repr]}
    with pytest.raises(AttributeError):
        glue.set_wrappers(model, "K", {"NO_SUCH_TYPE": repr})


def test_every_patched_model_trims_the_heap_once_after_each_sampling_run(patcher_extension, monkeypatch):
    trims = []
    monkeypatch.setattr(glue, "trim_heap", lambda: trims.append("trim"))
    first = glue.patched_clone(WrappedPatcher(), "A", {"APPLY_MODEL": repr})
    second = glue.patched_clone(first, "B")
    (outer,) = keyed_wrappers(second, glue.HEAP_TRIM_KEY)["outer_sample"]
    assert keyed_wrappers(second, glue.HEAP_TRIM_KEY) == {"outer_sample": [outer]}, "chained nodes install it once"

    def sampling(*args):
        trims.append("sampled")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        outer(sampling, "noise")
    assert trims == ["sampled", "trim"], "after the run, failed or not"


def test_the_outermost_vae_wrapper_trims_the_heap_once_per_call(prompts, monkeypatch):
    trims, log = [], []
    monkeypatch.setattr(glue, "trim_heap", lambda: trims.append(len(log)))
    second = glue.wrap_vae_methods(glue.wrap_vae_methods(FakeVAE(), _tracing(log, "first")), _tracing(log, "second"))
    second.decode(1), second.encode(2)
    assert trims == [2, 4], "once after each call, when both wrappers are done"


def test_records_on_models_replace_per_node():
    model = WrappedPatcher()
    glue.record_model(model, "A", "x", "y")
    glue.record_model(model, "A", "x", "z", "again")
    glue.record_model(model, "B", "1", "2")
    assert glue.model_records(model.model_options) == [
        {"node": "A", "requested": "x", "active": "z", "note": "again", "short": ""},
        {"node": "B", "requested": "1", "active": "2", "note": "", "short": ""},
    ]
    assert model.model_options[glue.RECORDS_KEY] is glue.model_records(model.model_options)
    clone = model.clone()
    glue.record_model(clone, "A", "x", "clone")
    assert glue.model_records(model.model_options)[0]["active"] == "z", "a clone's records are its own"


def test_record_in_run_reaches_only_an_active_run():
    glue.record_in_run("A", "auto", "sdpa")  # no run: nothing happens
    seed = [{"node": "A", "requested": "auto", "active": "auto (pending)", "note": ""}]
    run = SamplingRun("r", "cpu", seed)
    with run.memory_scope():
        glue.record_in_run("A", "auto", "sdpa", "timed")
    assert run.optimizations == [{"node": "A", "requested": "auto", "active": "sdpa", "note": "timed", "short": ""}]
    assert seed[0]["active"] == "auto (pending)"


# --- f. VAE copies -------------------------------------------------------------------------------------


class FakeVAE:
    """Like ComfyUI's VAE: a plain class with decode/encode methods and no clone()."""

    def __init__(self):
        self.calls = []
        self.first_stage_model = nn.Identity()

    def decode(self, samples):
        self.calls.append(("decode", samples))
        return samples * 2

    def encode(self, pixels):
        self.calls.append(("encode", pixels))
        return pixels / 2


def _tracing(log, tag):
    def wrap(name, inner):
        def call(self, *args, **kwargs):
            log.append((tag, name, self))
            return inner(self, *args, **kwargs)

        return call

    return wrap


def test_wrapped_vae_files_its_records_on_every_call(prompts):
    vae, log = FakeVAE(), []
    out = glue.wrap_vae_methods(vae, _tracing(log, "one"))
    glue.record_vae(out, "SDOptVAEPrecision", "fp16", "fp16")
    assert not hasattr(vae, "sdopt_records"), "the input VAE gets no records"
    assert out.decode(3) == 6 and out.encode(4) == 2
    assert log == [("one", "decode", out), ("one", "encode", out)]
    assert vae.calls == [("decode", 3), ("encode", 4)], "the shared state is the input's (a shallow copy)"
    assert prompt_context.prompt_log(PROMPT).records == [{"node": "SDOptVAEPrecision", "requested": "fp16", "active": "fp16", "note": "", "short": ""}]
    out.decode(1)
    assert len(prompt_context.prompt_log(PROMPT).records) == 1, "one record per node, however many calls"
    prompt_context._prompts.clear()
    out.decode(1)  # a later prompt served this VAE node from cache: the record comes again
    assert prompt_context.prompt_log(PROMPT).records[0]["node"] == "SDOptVAEPrecision"
    assert not hasattr(out, "decode_tiled"), "methods the VAE lacks are not invented"


def test_input_vae_methods_are_unchanged(prompts):
    vae = FakeVAE()
    glue.wrap_vae_methods(vae, _tracing([], "one"))
    assert "decode" not in vars(vae) and vae.decode.__func__ is FakeVAE.decode
    assert vae.decode(2) == 4 and prompt_context.prompt_log(PROMPT).records == []


def test_chained_copies_run_every_wrapper_on_their_own_self(prompts):
    vae, log = FakeVAE(), []
    first = glue.wrap_vae_methods(vae, _tracing(log, "first"))
    glue.record_vae(first, "SDOptVAEPrecision", "fp16", "fp16")
    second = glue.wrap_vae_methods(first, _tracing(log, "second"))
    glue.record_vae(second, "SDOptVAEAttention", "sdpa", "sdpa")
    assert second.decode(5) == 10
    assert log == [("second", "decode", second), ("first", "decode", second)]
    assert [r["node"] for r in prompt_context.prompt_log(PROMPT).records] == ["SDOptVAEPrecision", "SDOptVAEAttention"]
    assert [r["node"] for r in first.sdopt_records] == ["SDOptVAEPrecision"], "a later node's record stays on its copy"
    log.clear()
    first.decode(1)
    assert log == [("first", "decode", first)], "the earlier copy still runs only its own wrapper"


def test_copy_vae_rebinds_methods_and_copies_records():
    vae = FakeVAE()
    vae.sdopt_records = [{"node": "A", "requested": "x", "active": "y", "note": ""}]
    vae.helper = types.MethodType(lambda self: self, vae)
    vae.foreign = types.MethodType(lambda self: self, object())
    duplicate = glue.copy_vae(vae)
    assert duplicate.helper() is duplicate and vae.helper() is vae
    assert duplicate.foreign is vae.foreign, "methods bound to something else are left alone"
    glue.record_vae(duplicate, "A", "x", "z")
    assert vae.sdopt_records[0]["active"] == "y"


def test_comfyui_version_without_comfyui():
    assert glue.comfyui_version() is None


# --- g. the attention override --------------------------------------------------------------------------


@pytest.fixture
def comfy_attention(monkeypatch):
    module = types.SimpleNamespace(get_attn_precision=lambda precision, dtype: precision)
    monkeypatch.setattr(glue, "comfy_attention", lambda: module)
    return module


def _packed_qkv(dtype=torch.float32, batch=2, tokens=24, context=9, heads=4, head_dim=8):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(batch, tokens, heads * head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, context, heads * head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _sdpa_packed(q, k, v, heads):
    b = q.shape[0]
    split = [t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split)
    return out.transpose(1, 2).reshape(b, -1, q.shape[-1])


class Recorder:
    def __init__(self, result=None):
        self.calls, self.result = [], result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.mark.parametrize("extra, low_precision", [
    ({"scale": 0.1}, False), ({"enable_gqa": True}, False), ({"scale": 0.1, "enable_gqa": False}, False),
    ({"low_precision_attention": False}, True),
], ids=["scale", "gqa", "scale+gqa", "full precision from a low-precision backend"])
def test_override_hands_custom_scale_and_gqa_back_to_comfyui(comfy_attention, extra, low_precision):
    attention, report, func = Recorder(), Recorder(), Recorder(result="comfy's output")
    override = attention_node.comfy_attention_override(attention, report, low_precision)
    q, k, v = _packed_qkv()
    mask = torch.zeros(24, 9)
    kwargs = {"mask": mask, "attn_precision": torch.float32, "skip_reshape": False, "skip_output_reshape": True,
              "transformer_options": {"a": 1}, "_inside_attn_wrapper": True, **extra}
    assert override(func, q, k, v, 4, **kwargs) == "comfy's output"
    ((args, got),) = func.calls
    assert args[:3] == (q, k, v) and args[3] == 4 and len(args) == 4
    assert got == kwargs, "ComfyUI's function receives the same keyword arguments"
    assert report.calls == [((), {"delegated": True})]
    assert attention.calls == []


def test_override_hands_calls_no_sdopt_backend_takes_to_comfyui_when_falling_back(comfy_attention):
    """fp64 inputs: no sdopt backend runs them. ``fallback`` never fails the prompt: ComfyUI's own
    function runs that call, and the report hears of it."""
    report, func = Recorder(), Recorder(result="comfy's output")
    override = attention_node.comfy_attention_override(build_attention(AttentionConfig(backend="sdpa")), report)
    q, k, v = _packed_qkv(torch.float64)
    assert override(func, q, k, v, 4) == "comfy's output"
    ((args, _),) = func.calls
    assert args[:4] == (q, k, v, 4)
    assert report.calls == [((), {"delegated": True})]
    with pytest.raises(UserError, match="sdpa cannot run here"):
        error = attention_node.comfy_attention_override(build_attention(AttentionConfig(backend="sdpa", on_unavailable="error")), Recorder())
        error(Recorder(), q, k, v, 4)


@pytest.mark.parametrize("extra", [{}, {"scale": None}, {"enable_gqa": False}, {"transformer_options": {}},
                                   {"low_precision_attention": False}, {"low_precision_attention": True}])
def test_override_runs_the_sdopt_attention(comfy_attention, extra):
    report, func = Recorder(), Recorder()
    seen = []

    def attention(q, k, v, mask=None):
        seen.append(q.shape)
        return naive_attention(q, k, v, mask)

    override = attention_node.comfy_attention_override(attention, report)
    q, k, v = _packed_qkv()
    out = override(func, q, k, v, 4, **extra)
    assert func.calls == [] and report.calls == [((), {})]
    assert seen == [(2, 4, 24, 8)]
    torch.testing.assert_close(out, _sdpa_packed(q, k, v, 4), atol=1e-5, rtol=0)


def test_override_positional_arguments_and_reshape_flags(comfy_attention):
    override = attention_node.comfy_attention_override(backend_function("sdpa"), Recorder())
    q, k, v = _packed_qkv()
    split = [t.view(2, -1, 4, 8).transpose(1, 2) for t in (q, k, v)]
    expected = _sdpa_packed(q, k, v, 4)
    out = override(Recorder(), *split, 4, None, None, True, True)
    torch.testing.assert_close(out, expected.view(2, -1, 4, 8).transpose(1, 2), atol=1e-5, rtol=0)
    out = override(Recorder(), *split, 4, skip_reshape=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_override_upcasts_where_comfyui_asks_for_fp32(comfy_attention, monkeypatch):
    seen = []

    def attention(q, k, v, mask=None):
        seen.append(q.dtype)
        return naive_attention(q, k, v, mask)

    override = attention_node.comfy_attention_override(attention, Recorder())
    q, k, v = _packed_qkv(torch.bfloat16)
    assert override(Recorder(), q, k, v, 4, attn_precision=torch.float32).dtype == torch.bfloat16
    assert override(Recorder(), q, k, v, 4).dtype == torch.bfloat16
    assert seen == [torch.float32, torch.bfloat16]
    comfy_attention.get_attn_precision = lambda precision, dtype: None  # --dont-upcast-attention
    override(Recorder(), q, k, v, 4, attn_precision=torch.float32)
    assert seen[-1] == torch.bfloat16
    monkeypatch.setattr(glue, "comfy_attention", lambda: types.SimpleNamespace())  # no get_attn_precision
    override(Recorder(), q, k, v, 4, attn_precision=torch.float32)
    assert seen[-1] == torch.float32


def _attention_model():
    model = WrappedPatcher()
    model.load_device = "cpu"
    model.model_options["transformer_options"]["kept"] = 1
    return model


def test_attention_node_records_what_ran_in_each_run(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()  # ComfyUI 0.3.60+: per-model attention override
    model = _attention_model()
    (m,) = attention_node.SDOptAttention().patch(model, "sliced", "fallback", 0, 32)
    assert attention_node.OVERRIDE_KEY not in model.model_options["transformer_options"], "the input model is unchanged"
    options = m.model_options["transformer_options"]
    assert options["kept"] == 1
    records = glue.model_records(m.model_options)
    assert records == [{"node": "SDOptAttention", "requested": "sliced", "active": "sliced", "note": "", "short": ""}]
    override = options[attention_node.OVERRIDE_KEY]
    q, k, v = _packed_qkv()
    run = SamplingRun("r", "cpu", records)
    with run.memory_scope():
        torch.testing.assert_close(override(Recorder(), q, k, v, 4), _sdpa_packed(q, k, v, 4), atol=1e-5, rtol=0)
        assert run.optimizations[0]["active"] == "sliced"
        override(Recorder(), q, k, v, 4, scale=0.5)
    assert run.optimizations == [{"node": "SDOptAttention", "requested": "sliced", "active": "sliced", "note": attention_node.DELEGATED,
                                  "short": "some calls ran ComfyUI's own attention (custom scale, grouped-query or full precision asked)"}]
    assert records[0]["note"] == "", "the model's own record is not changed by a run"


def test_attention_node_auto_is_pending_until_sampling(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "auto", "fallback", 0, 32)
    (record,) = glue.model_records(m.model_options)
    assert record["active"] == "auto (pending)" and record["note"] == attention_node.AUTO_NOTE
    run = SamplingRun("r", "cpu", [record])
    with run.memory_scope():
        m.model_options["transformer_options"][attention_node.OVERRIDE_KEY](Recorder(), *_packed_qkv(), 4)
    (ran,) = run.optimizations
    assert ran["active"] != "auto (pending)" and "rejected: " in ran["note"] and "sdpa_efficient (sdpa_efficient needs CUDA)" in ran["note"]


def test_attention_node_files_its_pick_in_runs_whose_attention_never_reaches_python(comfy_attention, patcher_extension):
    """Under a traced or compiled forward only the first run's attention calls run in Python: every
    later run's record still names what ran, filed as sampling ends."""
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "auto", "fallback", 0, 32)
    (record,) = glue.model_records(m.model_options)
    (after_sampling,) = keyed_wrappers(m, attention_node.NODE)["sampler_sample"]
    override = m.model_options["transformer_options"][attention_node.OVERRIDE_KEY]
    picks = []
    for calls in (1, 0, 0):  # eager, then traced twice
        run = SamplingRun("r", "cpu", [record])
        with run.memory_scope():
            after_sampling(lambda: [override(Recorder(), *_packed_qkv(), 4) for _ in range(calls)])
        (ran,) = run.optimizations
        picks.append(ran["active"])
    assert picks[0] != "auto (pending)" and picks == [picks[0]] * 3


def test_attention_node_falls_back_with_a_note(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "sdpa_efficient", "fallback", 0, 32)
    (record,) = glue.model_records(m.model_options)
    assert record["active"] == "sdpa" and record["note"] == "fallback from sdpa_efficient to sdpa: sdpa_efficient needs CUDA"
    assert record["short"] == "ran sdpa instead of sdpa_efficient", "one line for the report table"
    with pytest.raises(UserError, match="needs CUDA"):
        attention_node.SDOptAttention().patch(_attention_model(), "sdpa_efficient", "error", 0, 32)


def test_attention_node_on_comfyui_without_the_override(comfy_attention, patcher_extension):
    model = _attention_model()
    (m,) = attention_node.SDOptAttention().patch(model, "sdpa", "fallback", 0, 32)
    assert attention_node.OVERRIDE_KEY not in m.model_options["transformer_options"]
    assert glue.model_records(m.model_options)[0]["active"] == "ComfyUI default"
    with pytest.raises(UserError, match="^backend: this ComfyUI has no per-model attention override"):
        attention_node.SDOptAttention().patch(model, "sdpa", "error", 0, 32)


# --- h. the profiler wrappers ----------------------------------------------------------------------------


class SamplerExecutor:
    """ComfyUI's SAMPLER_SAMPLE executor: records what it got and calls the callback once per step."""

    def __init__(self, steps=3):
        self.steps, self.calls = steps, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        callback = args[3] if len(args) > 3 else kwargs.get("callback")
        for i in range(self.steps):
            if callback is not None:
                callback(i, None, None, self.steps)
        return "samples"


def test_sampler_sample_wraps_a_positional_callback_and_passes_the_rest(monkeypatch):
    heard, executor = [], SamplerExecutor()
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        out = profiler_node._sampler_sample(executor, "guider", "sigmas", {"x": 1}, lambda *a: heard.append(a), "noise", "latent",
                                            denoise_mask=None, disable_pbar=True, new_argument="passed")
    assert out == "samples"
    ((args, kwargs),) = executor.calls
    assert args[:3] == ("guider", "sigmas", {"x": 1}) and args[4:] == ("noise", "latent")
    assert kwargs == {"denoise_mask": None, "disable_pbar": True, "new_argument": "passed"}
    assert heard == [(i, None, None, 3) for i in range(3)], "the original callback still hears every step"
    assert len(run.result().steps) == 3


def test_sampler_sample_wraps_a_keyword_callback(monkeypatch):
    heard, executor = [], SamplerExecutor(2)
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        profiler_node._sampler_sample(executor, "guider", "sigmas", callback=lambda *a: heard.append(a), latent_shapes=[(1, 4, 8, 8)])
    ((args, kwargs),) = executor.calls
    assert args == ("guider", "sigmas") and kwargs["latent_shapes"] == [(1, 4, 8, 8)]
    assert len(heard) == 2 and len(run.result().steps) == 2


def test_sampler_sample_steps_without_a_callback():
    executor = SamplerExecutor(2)
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        profiler_node._sampler_sample(executor, "guider", "sigmas", {}, None, "noise")
    (args, _), = executor.calls
    assert callable(args[3]) and len(run.result().steps) == 2


def test_sampler_sample_outside_a_run_passes_everything_unchanged():
    executor, callback = SamplerExecutor(1), print
    assert active_run() is None
    profiler_node._sampler_sample(executor, "g", "s", {}, callback, extra=1)
    assert executor.calls == [(("g", "s", {}, callback), {"extra": 1})]


class OuterExecutor:
    """ComfyUI's OUTER_SAMPLE executor: ``class_obj`` is the guider; sampling runs the inner wrapper."""

    def __init__(self, records, config_class=None):
        patcher = types.SimpleNamespace(load_device="cpu", model=base_model(config_class or SD15))
        self.class_obj = types.SimpleNamespace(model_patcher=patcher, model_options={glue.RECORDS_KEY: records})
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        assert active_run() is not None, "sampling runs inside the run's memory scope"
        return profiler_node._sampler_sample(SamplerExecutor(4), self.class_obj, "sigmas", {}, None, "noise")


def test_outer_sample_files_a_run_and_passes_new_arguments(prompts, monkeypatch):
    timers = []
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda prompt_id, node_id=None: timers.append((prompt_id, node_id)))
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    records = [{"node": "SDOptAttention", "requested": "auto", "active": "auto (pending)", "note": ""}]
    executor = OuterExecutor(records)
    outer = profiler_node._outer_sample("fp16 run")
    out = outer(executor, "noise", "latent", "sampler", "sigmas", None, None, False, 42, latent_shapes=[(1, 4, 8, 8)])
    assert out == "samples"
    assert executor.calls == [(("noise", "latent", "sampler", "sigmas", None, None, False, 42), {"latent_shapes": [(1, 4, 8, 8)]})]
    assert timers == [(PROMPT, "5")]
    (run,) = prompt_context.prompt_log(PROMPT).runs
    assert run["label"] == "fp16 run" and len(run["steps"]) == 4 and run["memory_kind"] == "ram_rss"
    assert run["model_family"] == "SD1.5"
    assert run["optimizations"] == records and run["optimizations"][0] is not records[0]
    assert active_run() is None
    outer(executor, "noise", "latent", "sampler", "sigmas")
    assert len(prompt_context.prompt_log(PROMPT).runs) == 2, "every sampling run is filed"


@pytest.mark.parametrize("config_class,family", [(SSD1B, "SDXL"), (AuraFlow, "family unknown (AuraFlow)")])
def test_each_run_names_the_model_family(prompts, monkeypatch, config_class, family):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    profiler_node._outer_sample("run")(OuterExecutor([], config_class), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["model_family"] == family


def test_outer_sample_counts_dynamic_vram_where_comfyui_0_38_maps_it(prompts, monkeypatch):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    outer = profiler_node._outer_sample("dynamic")
    install(monkeypatch, "comfy.memory_management", aimdo_enabled=False)
    install(monkeypatch, "comfy_aimdo.control", get_total_vram_usage=lambda: 3 * 2**30)
    outer(OuterExecutor([]), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["peak_outside_allocator_bytes"] is None, "aimdo off: nothing to count"
    sys.modules["comfy.memory_management"].aimdo_enabled = True
    outer(OuterExecutor([]), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["peak_outside_allocator_bytes"] == 3 * 2**30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**30)  # counted by aimdo's hook too
    assert glue.dynamic_vram_probe("cuda:0")() == 2 * 2**30
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4 * 2**30)
    assert glue.dynamic_vram_probe("cuda:0")() == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # aimdo's total is every GPU's
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**30)
    assert glue.dynamic_vram_probe("cuda:0")() == 2**30
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)  # enabled, but the package cannot be imported
    assert glue.dynamic_vram_probe("cuda:0") is None


def test_memory_mode_names_dynamic_vram_and_when_a_server_would_differ(monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy.memory_management", types.ModuleType("comfy.memory_management"))
    assert glue.memory_mode("cuda:0") == (None, ""), "a ComfyUI without dynamic VRAM"
    sys.modules["comfy.memory_management"].aimdo_enabled = True
    assert glue.memory_mode("cuda:0") == (glue.DYNAMIC_VRAM, "")
    sys.modules["comfy.memory_management"].aimdo_enabled = False
    monkeypatch.setitem(sys.modules, "comfy_aimdo", types.ModuleType("comfy_aimdo"))
    args = types.SimpleNamespace(disable_dynamic_vram=False)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", types.SimpleNamespace(args=args))
    assert glue.memory_mode("cuda:0") == (glue.CLASSIC_MEMORY, ""), "off without being told: as a server here would be"
    args.disable_dynamic_vram = True  # --disable-dynamic-vram, or the headless runner's --memory-mode classic
    mode, note = glue.memory_mode("cuda:0")
    assert mode == glue.CLASSIC_MEMORY and note.startswith("dynamic VRAM turned off (--disable-dynamic-vram or --memory-mode classic)")
    assert glue.memory_mode("cpu") == (glue.CLASSIC_MEMORY, ""), "no server turns it on for a CPU"
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)
    assert glue.memory_mode("cuda:0") == (glue.CLASSIC_MEMORY, ""), "nor without comfy-aimdo"


def test_profiler_node_clones_with_its_wrappers(patcher_extension, prompts, monkeypatch):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    model = WrappedPatcher()
    (out,) = profiler_node.SDOptProfiler().apply(model, "  base  ")
    keyed = keyed_wrappers(out, profiler_node.NODE)
    assert set(keyed) == {"outer_sample", "sampler_sample"} and keyed["sampler_sample"] == [profiler_node._sampler_sample]
    assert keyed_wrappers(model, profiler_node.NODE) == {}
    with pytest.raises(UserError, match="^label: "):
        profiler_node.SDOptProfiler().apply(model, "   ")


# --- the model's family -------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class,label,known", [(SD15, "SD1.5", True), (SSD1B, "SDXL", True), (AuraFlow, "family unknown (AuraFlow)", False)])
def test_model_family_comes_from_comfyuis_config_class(config_class, label, known):
    family = glue.model_family(FastPatcher(config_class))
    assert family.label == label and (family.family is not None) == known
    assert family.config_class == config_class.__name__
    if known:
        assert family.unknown_note == "" and family.described is family.family
    else:
        assert family.described.title == "SD1.5", "an unknown family is served as the UNet sdopt served before families"
        assert family.unknown_note.startswith("family unknown (AuraFlow): ") and "(x, timesteps, context, y)" in family.unknown_note


def test_model_family_of_a_model_without_a_config_names_its_class():
    class CustomModel:
        pass

    family = glue.model_family(types.SimpleNamespace(model=CustomModel()))
    assert family.family is None and family.label == "family unknown (CustomModel)"


# --- the low-memory node -------------------------------------------------------------------------------


class Mlp(nn.Module):
    """A token-wise feed-forward under a class name only a family can tell Low Memory about."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 8)
        self.tokens_seen = []

    def forward(self, x):
        self.tokens_seen.append(x.shape[-2])
        return self.down(torch.relu(self.up(x)))


@torch.inference_mode()
def test_low_memory_slices_the_feedforward_modules_its_family_names(patcher_extension, comfy_attention, monkeypatch):
    import dataclasses

    from sdopt import families
    from sdopt.nodes.lowmem import NODE, SDOptLowMemory

    comfy_attention.wrap_attn = object()
    monkeypatch.setitem(families.FAMILIES, "sdxl", dataclasses.replace(families.SDXL, feedforward_modules=("Mlp",)))
    x = torch.randn(1, 4096, 8)  # hidden activations of 2 MiB against a 1 MiB budget
    tokens = {}
    for config_class in (SDXL, SD15):
        (m,) = SDOptLowMemory().patch(FastPatcher(config_class), 1, False, True)
        (apply_model,) = keyed_wrappers(m, NODE)["apply_model"]
        mlp = Mlp()
        torch.testing.assert_close(apply_model(ApplyModelExecutor(lambda x, *a, **k: mlp(x), mlp), x, None), Mlp()(x), rtol=1e-5, atol=1e-6)
        tokens[config_class.__name__] = max(mlp.tokens_seen)
    assert tokens == {"SDXL": 2048, "SD15": 4096}, "only the family that names Mlp slices it"


@torch.inference_mode()
def test_sequential_cfg_splits_sdxls_y_with_the_batch(patcher_extension, comfy_attention):
    from sdopt.nodes.lowmem import NODE, SDOptLowMemory

    comfy_attention.wrap_attn = object()
    (m,) = SDOptLowMemory().patch(FastPatcher(SDXL), 256, True, True)
    (apply_model,) = keyed_wrappers(m, NODE)["apply_model"]
    unet, seen = TinyXLUNet(), []

    def executor(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        seen.append((x.shape[0], kwargs["y"].shape[0]))
        return unet._forward(x, t, c_crossattn, kwargs["y"])

    x, t, context = unet_inputs()
    y = sdxl_vector(0)
    out = apply_model(ApplyModelExecutor(executor, unet), x, t, None, context, None, {}, y=y)
    assert seen == [(1, 1), (1, 1)], "cond and uncond one after the other, each with its own y"
    torch.testing.assert_close(out, unet._forward(x, t, context, y), rtol=1e-5, atol=1e-6)


# --- inputs: one message per bad input, under its own name, for every node ---------------------------


def _checked_nodes():
    from sdopt.nodes.registry import NODE_CLASS_MAPPINGS

    # Tiled VAE checks its inputs itself (tests/host/nodes/test_tiled_vae.py); Doctor takes only a file prefix it saves under
    return {name: cls for name, cls in NODE_CLASS_MAPPINGS.items() if name not in ("SDOptTiledVAE", "SDOptDoctor")}


def _spec(cls) -> dict:
    return {name: entry for kind, section in cls.INPUT_TYPES().items() if kind != "hidden" for name, entry in section.items()}


def _good(kind, options):
    if isinstance(kind, list):
        return options.get("default", kind[0])
    return options.get("default", {"BOOLEAN": False, "STRING": "x", "INT": 1, "FLOAT": 1.0}.get(kind))


def _bad(kind, options):
    if isinstance(kind, list):
        return "not-an-option"
    if kind in ("INT", "FLOAT"):
        return options["min"] - 1 if "min" in options else "many"
    return {"BOOLEAN": "yes", "STRING": 5}.get(kind)


CHECKED_INPUTS = [(name, input_name) for name, cls in _checked_nodes().items() for input_name, (kind, *rest) in _spec(cls).items()
                  if _bad(kind, rest[0] if rest else {}) is not None]


@pytest.mark.parametrize("node,input_name", CHECKED_INPUTS, ids=[f"{n}.{i}" for n, i in CHECKED_INPUTS])
def test_a_bad_value_gets_one_message_under_its_own_input(node, input_name):
    cls = _checked_nodes()[node]
    spec = _spec(cls)
    values = {name: _good(kind, rest[0] if rest else {}) for name, (kind, *rest) in spec.items()}
    kind, *rest = spec[input_name]
    values[input_name] = _bad(kind, rest[0] if rest else {})
    with pytest.raises(UserError) as raised:
        getattr(cls(), cls.FUNCTION)(**values)
    message = str(raised.value)
    assert message.startswith(f"{input_name}: "), message
    others = [name for name in spec if name != input_name and re.search(rf"(?<!\w){name}: ", message)]
    assert others == [], f"the message is filed under {others} too: {message}"
    assert "; " not in message, "one message"


def test_two_bad_inputs_get_a_message_each():
    with pytest.raises(UserError) as raised:
        glue.check_inputs(attention_node.SDOptAttention, backend="fastest", on_unavailable="fallback", slice_size=-1, memory_budget_mb=0)
    assert str(raised.value) == (
        f"backend: 'fastest' is not offered (choose one of {', '.join(attention_node.attention_choices())}); "
        "slice_size: -1 is below its minimum (give 0 or more); memory_budget_mb: 0 is below its minimum (give 1 or more)"
    )


@pytest.mark.parametrize("kind,options,value,problem", [
    ("INT", {"min": 1, "max": 64}, 65, "65 is above its maximum (give 64 or less)"),
    ("INT", {}, 2.5, "2.5 is not a whole number"),
    ("INT", {}, True, "True is not a whole number"),
    ("FLOAT", {}, float("nan"), "nan is not a number"),
    ("FLOAT", {"min": 0.0}, 0.5, None),
    ("BOOLEAN", {}, 1, "1 is not true or false"),
    ("MODEL", {}, object(), None),
])
def test_input_problems(kind, options, value, problem):
    assert glue._input_problem(kind, options, value) == problem


def test_free_for_work_leaves_comfyuis_reserved_vram(monkeypatch):
    install(monkeypatch, "comfy.model_management", extra_reserved_memory=lambda: 600 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    assert glue.free_for_work(torch.device("cuda", 0)) == (4 << 30) - (600 << 20)
    sys.modules["comfy.model_management"].get_free_memory = lambda device: 4 << 30
    streaming = types.SimpleNamespace(get_free_memory=lambda device: 7 << 30)  # 0.38: plus 3 GiB its streamed weights give back
    assert glue.free_for_work(torch.device("cuda", 0), streaming) == (7 << 30) - (600 << 20)
    assert glue.free_for_work(torch.device("cuda", 0), types.SimpleNamespace()) == (4 << 30) - (600 << 20), "0.3.x patchers"
    # host memory has no VRAM reserve
    from sdopt.optim.tiled_vae import free_memory
    assert abs(glue.free_for_work(torch.device("cpu")) - free_memory("cpu")) < 256 << 20


def test_fall_back_or_raise_is_every_nodes_on_unavailable():
    from sdopt.errors import Unavailable

    problem = Unavailable("no GPU here", "run it on a GPU", "mode")
    assert glue.fall_back_or_raise("fallback", None, "run eager") is None
    assert glue.fall_back_or_raise("error", None, "run eager") is None
    assert glue.fall_back_or_raise("fallback", problem, "run eager") == "no GPU here"
    with pytest.raises(UserError) as raised:
        glue.fall_back_or_raise("error", problem, "run eager")
    assert str(raised.value) == "mode: no GPU here; run it on a GPU (or set on_unavailable to fallback to run eager)"


class BaseModel038:
    """ComfyUI's BaseModel where ``estimate_memory`` passes the attention's memory profile."""

    def memory_required(self, input_shape, cond_shapes={}, memory_efficient_attention=None):
        return 0


class BaseModel033:
    def memory_required(self, input_shape, cond_shapes={}):
        return 0


@pytest.mark.parametrize(("backend", "profile"), [
    ("sliced", True), ("sub_quadratic", True), ("low_memory", True), ("naive", False), ("sdpa_math", False),
    ("auto", None), ("sdpa", None), ("sdpa_efficient", None),  # sdpa_efficient needs CUDA: it falls back to sdpa here
])
def test_attention_node_tells_comfyuis_memory_estimate_how_its_attention_grows(
        comfy_attention, patcher_extension, monkeypatch, backend, profile):
    comfy_attention.wrap_attn = object()
    install(monkeypatch, "comfy.model_base", BaseModel=BaseModel038)
    model = _attention_model()
    model.model_options[glue.ATTENTION_MEMORY_KEY] = False  # an earlier node's override (ComfyUI's default profile)
    (m,) = attention_node.SDOptAttention().patch(model, backend, "fallback", 0, 32)
    assert m.model_options.get(glue.ATTENTION_MEMORY_KEY) is profile, "None: left to ComfyUI's own backend's profile"
    assert model.model_options[glue.ATTENTION_MEMORY_KEY] is False, "the input model is unchanged"


def test_an_older_comfyui_gets_no_memory_profile(comfy_attention, patcher_extension, monkeypatch):
    comfy_attention.wrap_attn = object()
    install(monkeypatch, "comfy.model_base", BaseModel=BaseModel033)
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "sliced", "fallback", 0, 32)
    assert glue.ATTENTION_MEMORY_KEY not in m.model_options
