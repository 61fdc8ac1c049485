"""nodes.private_copy against fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes): a patcher of another
module with the same recipe, quantized models refused, and private copies of a model's or a VAE's weights.

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import copy
import gc
import types
import uuid

import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.nodes import private_copy
from sdopt.optim.precision import converted_copy

from .comfy_fakes import FakeVAE, install

pytestmark = pytest.mark.usefixtures("no_comfyui")


# --- rebased: a patcher of another module with the same recipe ------------------------------------


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
    rebased = private_copy.rebased(patcher, module)
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
    rebased = private_copy.rebased(patcher, module)
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

    fresh = private_copy.rebased(patcher, module)
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


# --- is_quantized, refuse_quantized ----------------------------------------------------------------


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
    assert private_copy.is_quantized(_model(config))
    with pytest.raises(UserError, match=r"^weight_dtype: this model holds quantized weights.*; set it to default \("):
        private_copy.refuse_quantized(_model(config), "weight_dtype", "set it to default")


def test_refuse_quantized_instance_attribute():
    config = Plain()
    config.scaled_fp8 = torch.float8_e4m3fn  # as ComfyUI's model detection sets it
    with pytest.raises(UserError, match="^dtype: "):
        private_copy.refuse_quantized(_model(config), "dtype", "set it to default")


def test_refuse_quantized_tensor_subclass_parameters():
    module = nn.Linear(2, 2)
    module.weight = nn.Parameter(torch.randn(2, 2).as_subclass(QuantizedTensor), requires_grad=False)
    assert type(module.weight) is QuantizedTensor, "Parameter keeps a tensor subclass's type"
    with pytest.raises(UserError, match="weight_dtype"):
        private_copy.refuse_quantized(_model(Plain(), module), "weight_dtype", "set it to default")


def test_plain_models_pass_without_calling_getattr():
    config = Config033()
    assert config.anything is None and config.asked == ["anything"], "the fake behaves like 0.33's"
    config.asked.clear()
    assert not private_copy.is_quantized(_model(config)) and not private_copy.is_quantized(_model(Plain()))
    private_copy.refuse_quantized(_model(config), "weight_dtype", "set it to default")
    assert config.asked == [], "quantization is read without __getattr__"


# --- _shallow_module_copy --------------------------------------------------------------------------


def test_shallow_module_copy_has_its_own_tables():
    original = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    original.register_buffer("scale", torch.ones(1))
    original.tag = "shared"
    child, weight = original[0], original[0].weight
    duplicate = private_copy._shallow_module_copy(original)
    assert type(duplicate) is nn.Sequential and duplicate.tag == "shared"
    assert duplicate[0] is child, "children are shared until replaced"
    duplicate[0] = nn.Identity()
    duplicate.scale = torch.zeros(1)
    duplicate.extra = nn.Parameter(torch.ones(1))
    assert original[0] is child and original[0].weight is weight
    assert torch.equal(original.scale, torch.ones(1)) and not hasattr(original, "extra")
    assert isinstance(duplicate[0], nn.Identity)


# --- private_copy -----------------------------------------------------------------------------------


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

    copy_patcher = private_copy.private_copy(patcher, convert)
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
    copy_patcher = private_copy.private_copy(patcher, lambda module: converted_copy(module, torch.bfloat16))
    assert copy_patcher.model is not base and copy_patcher.model.diffusion_model[1].weight.dtype == torch.bfloat16
    assert copy_patcher.model_options == patcher.model_options
    assert base.diffusion_model[1].weight.dtype == torch.float32


def test_private_copy_refuses_weights_still_patched(model_management):
    base = BaseModel()
    base.current_weight_patches_uuid = uuid.uuid4()  # an unload that did not restore the weights
    with pytest.raises(RuntimeError, match="still has patched weights"):
        private_copy.private_copy(OverridePatcher(base), lambda module: module)


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
    return converted_copy(module, torch.bfloat16, leave_out=private_copy.DYNAMIC_VRAM_LAYER_STATE)


def test_private_copy_of_a_dynamically_loaded_model_takes_none_of_its_state(model_management):
    base = dynamically_loaded(BaseModel())
    patcher = DynamicPatcher(base)
    model_management.current_loaded_models[:] = [LoadedModel(patcher.clone())]
    vbars, layer_slot = base.dynamic_vbars, base.diffusion_model[0]._v
    copied = private_copy.private_copy(patcher, _convert).model
    assert model_management.current_loaded_models == []
    assert copied.current_weight_patches_uuid is None and base.current_weight_patches_uuid is not None, "a fresh model's state"
    assert copied.diffusion_model[1].weight.dtype == torch.bfloat16
    assert not any(hasattr(copied, name) for name in private_copy.DYNAMIC_VRAM_MODEL_STATE), "never the original's VRAM or pins"
    assert not any(hasattr(layer, name) for layer in copied.diffusion_model for name in private_copy.DYNAMIC_VRAM_LAYER_STATE), (
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
    assert private_copy.private_copy(given, _convert).model is not base


def test_private_vae_copy(model_management, prompts):
    vae = FakeVAE()
    vae.first_stage_model = nn.Conv2d(3, 3, 1)
    vae.patcher = OverridePatcher(vae.first_stage_model)
    vae.sdopt_records = [{"node": "N", "requested": "a", "active": "b", "note": ""}]
    model_management.current_loaded_models[:] = [LoadedModel(vae.patcher)]
    original = vae.first_stage_model
    duplicate = private_copy.private_vae_copy(vae, lambda module: converted_copy(module, torch.bfloat16))
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
    duplicate = private_copy.private_vae_copy(vae, _convert)
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
    first = private_copy.private_copy(OverridePatcher(base), _recording(converted, torch.bfloat16))
    second = private_copy.private_copy(first, _recording(converted, torch.float32), notes)
    third = private_copy.private_copy(second, _recording(converted, torch.float16), notes)
    assert converted == [original_unet] * 3, "never the bf16 copy, never the fp32 copy of it"
    assert private_copy.copy_source(third.model) == (base, "") and private_copy.copy_source(base) == (base, "")
    assert all(torch.equal(a, b) for a, b in zip(second.model.diffusion_model.parameters(), original_unet.parameters())), \
        "bf16 then fp32 holds the original fp32 weights, bit for bit"
    assert first.model.diffusion_model[1].weight.dtype == torch.bfloat16, "the first copy is left as it is"
    assert notes == []


def test_a_chained_copy_unloads_the_source_it_reads(model_management):
    base = BaseModel()
    first = private_copy.private_copy(OverridePatcher(base), lambda module: converted_copy(module, torch.bfloat16))
    source_loaded, copy_loaded = LoadedModel(OverridePatcher(base)), LoadedModel(first)
    model_management.current_loaded_models[:] = [source_loaded, copy_loaded]
    private_copy.private_copy(first, lambda module: converted_copy(module, torch.float32))
    assert source_loaded.unloaded == 1, "the weights read must be the unpatched originals"
    assert model_management.current_loaded_models == [copy_loaded]


def test_a_copy_whose_source_was_freed_converts_its_input_and_says_so(model_management):
    base = BaseModel()
    first = private_copy.private_copy(OverridePatcher(base), lambda module: converted_copy(module, torch.bfloat16))
    first.parent = None  # as on ComfyUI before 0.33, whose copy's patcher keeps no reference to its input
    del base
    gc.collect()
    converted, notes = [], []
    second = private_copy.private_copy(first, _recording(converted, torch.float32), notes)
    assert converted == [first.model.diffusion_model]
    assert notes == [private_copy.SOURCE_FREED]
    assert private_copy.copy_source(second.model)[0] is first.model


def test_a_chained_vae_copy_converts_the_weights_before_any_sdopt_copy(model_management, prompts):
    vae = FakeVAE()
    vae.first_stage_model = nn.Conv2d(3, 3, 1)
    vae.patcher = OverridePatcher(vae.first_stage_model)
    original = vae.first_stage_model
    converted = []
    first = private_copy.private_vae_copy(vae, _recording(converted, torch.bfloat16))
    second = private_copy.private_vae_copy(first, _recording(converted, torch.float32))
    assert converted == [original, original]
    assert torch.equal(second.first_stage_model.weight, original.weight)
    assert first.first_stage_model.weight.dtype == torch.bfloat16
