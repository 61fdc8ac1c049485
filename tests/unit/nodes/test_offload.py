"""SDOptOffload's wrappers against a fake of ComfyUI's patcher memory API (0.3.x and 0.38 shapes).

The fake keeps ComfyUI's bookkeeping: ``loaded_size()`` goes down by what ``partially_unload`` frees
and up by what ``partially_load`` loads, and the PREPARE_SAMPLING executor loads what "fits". The
host tier runs the same wrappers against real ComfyUI (tests/host/nodes/test_offload.py).
"""
import copy
import sys
import types

import pytest
import torch

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun
from sdopt.nodes import patching
from sdopt.nodes import offload as offload_node
from sdopt.optim.offload import MIB, OffloadConfig

MODEL_BYTES = 1600 * MIB


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    PREPARE_SAMPLING = "prepare_sampling"
    SAMPLER_SAMPLE = "sampler_sample"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"


class MemoryPatcher:
    """A ModelPatcher as model management sees it: sizes, partial load/unload, wrappers, clone."""

    def __init__(self, device="cuda"):
        self.load_device, self.offload_device = torch.device(device), torch.device("cpu")
        self.loaded = 0
        self.wrappers, self.model_options = {}, {"transformer_options": {}}
        self.unloads, self.loads = [], []

    def clone(self):
        n = copy.copy(self)
        n.wrappers = {k: {k1: w.copy() for k1, w in v.items()} for k, v in self.wrappers.items()}
        n.model_options = copy.deepcopy(self.model_options)
        n.unloads, n.loads = [], []
        return n

    def is_clone(self, other):
        return True

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def model_size(self):
        return MODEL_BYTES

    def loaded_size(self):
        return self.loaded

    def partially_unload(self, device_to, memory_to_free=0):
        assert device_to == self.offload_device
        self.unloads.append(memory_to_free)
        self.loaded -= min(memory_to_free, self.loaded)
        return memory_to_free

    def partially_load(self, device_to, extra_memory=0):
        assert device_to == self.load_device
        self.loads.append(extra_memory)
        self.loaded = min(MODEL_BYTES, self.loaded + extra_memory)
        return extra_memory


class DynamicMemoryPatcher(MemoryPatcher):
    """0.38's ModelPatcherDynamic: streams on its own; the delegate is a plain patcher."""

    def is_dynamic(self):
        return True

    def get_non_dynamic_delegate(self):
        delegate = MemoryPatcher.clone(self)
        delegate.__class__ = MemoryPatcher
        return delegate


@pytest.fixture
def comfy(monkeypatch):
    """Fake ``comfy.patcher_extension`` and ``comfy.model_management`` (2 offload streams)."""
    comfy_pkg = types.ModuleType("comfy")
    comfy_pkg.__path__ = []
    extension = types.ModuleType("comfy.patcher_extension")
    extension.WrappersMP = WrappersMP
    mm = types.ModuleType("comfy.model_management")
    mm.NUM_STREAMS, mm.current_loaded_models, mm.emptied = 2, [], []
    mm.soft_empty_cache = lambda: mm.emptied.append(True)
    comfy_pkg.patcher_extension, comfy_pkg.model_management = extension, mm
    for name, module in (("comfy", comfy_pkg), ("comfy.patcher_extension", extension), ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, module)
    return mm


def _prepare(model, fits: int, **new_kwargs):
    """Run the model's PREPARE_SAMPLING wrapper around an executor that loads ``fits`` bytes, inside
    a profiled run; returns (the run's offload record, what the executor was called with)."""
    (wrapper,) = model.wrappers[WrappersMP.PREPARE_SAMPLING][offload_node.NODE]
    seen = {}

    def executor(patcher, noise_shape, conds, model_options=None, **kwargs):
        seen.update(kwargs)
        patcher.loaded = MODEL_BYTES if kwargs.get("force_full_load") else fits
        return "real model", conds, []

    run = SamplingRun("t", "cpu")
    with run.memory_scope():
        assert wrapper(executor, model, (2, 4, 64, 64), {"positive": []}, model_options={}, **new_kwargs) == ("real model", {"positive": []}, [])
    (record,) = [r for r in run.optimizations if r["node"] == offload_node.NODE]
    return record, seen


def _node(model, mode, budget_mb=1024, on_unavailable="fallback"):
    return offload_node.SDOptOffload().patch(model, mode, budget_mb, on_unavailable)[0]


def test_budget_frees_what_exceeds_it_and_says_how_it_streams(comfy):
    original = MemoryPatcher()
    model = _node(original, "budget", 1024)
    record, _ = _prepare(model, fits=MODEL_BYTES)
    assert model.unloads == [MODEL_BYTES - 1024 * MIB] and model.loaded_size() == 1024 * MIB
    assert record["active"] == "budget 1,024 MiB: 1,024.0 of 1,600.0 MiB of weights resident, 576.0 MiB streamed per layer"
    assert "2 async offload streams" in record["note"]
    assert original.wrappers == {} and original.unloads == [], "the input model is untouched"


class PinningPatcher(MemoryPatcher):
    """A 0.3.6x+ patcher: the weights it pinned while it unloaded them (``pinned``, keys into its BaseModel)."""

    def __init__(self, pins: list[str]):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.diffusion_model = torch.nn.Linear(256, 1024)  # weight 1 MiB, bias 4 KiB in fp32
        self.pinned, self._pins = set(), pins

    def partially_unload(self, device_to, memory_to_free=0):
        self.pinned.update(self._pins)
        return super().partially_unload(device_to, memory_to_free)


@pytest.mark.parametrize("pins, says", [
    (["diffusion_model.weight", "diffusion_model.bias"], "1.0 MiB of the streamed weights in ComfyUI's pinned host memory"),
    ([], "none of the streamed weights is in pinned host memory (ComfyUI's --disable-pinned-memory, or its pinned-memory "
         "limit): copies from pageable RAM do not overlap compute"),
], ids=["pinned", "pageable"])
def test_the_record_says_how_much_of_the_streamed_weights_comfyui_pinned(comfy, pins, says):
    record, _ = _prepare(_node(PinningPatcher(pins), "sequential"), fits=MODEL_BYTES)
    assert says in record["note"]


def test_a_patcher_that_pins_nothing_of_its_own_adds_no_pinning_line(comfy):
    record, _ = _prepare(_node(MemoryPatcher(), "sequential"), fits=MODEL_BYTES)
    assert "pinned" not in record["note"]


def test_budget_never_loads_more_than_comfyui_chose(comfy):
    model = _node(MemoryPatcher(), "budget", 1024)
    _prepare(model, fits=512 * MIB)
    assert model.unloads == [] and model.loads == [] and model.loaded_size() == 512 * MIB


def test_sequential_frees_everything(comfy):
    comfy.NUM_STREAMS = 0
    model = _node(MemoryPatcher(), "sequential")
    record, _ = _prepare(model, fits=MODEL_BYTES)
    assert model.loaded_size() == 0 and record["active"].startswith("sequential: 0.0 of 1,600.0 MiB")
    assert "async offload is off" in record["note"]


def test_none_loads_the_rest_on_0_3_and_asks_for_a_full_load_on_0_38(comfy):
    model = _node(MemoryPatcher(), "none")
    record, seen = _prepare(model, fits=600 * MIB)
    assert seen == {} and model.loads == [MODEL_BYTES - 600 * MIB] and model.loaded_size() == MODEL_BYTES
    assert record["active"] == "none: 1,600.0 of 1,600.0 MiB of weights resident" and record["note"] == ""
    model = _node(MemoryPatcher(), "none")
    _, seen = _prepare(model, fits=600 * MIB, force_full_load=False, force_offload=False)
    assert seen == {"force_full_load": True, "force_offload": False} and model.loads == []


def test_prepare_passes_0_38_keywords_through_in_every_mode(comfy):
    model = _node(MemoryPatcher(), "budget", 100)
    _, seen = _prepare(model, fits=MODEL_BYTES, force_full_load=False, force_offload=True)
    assert seen == {"force_full_load": False, "force_offload": True}


def test_a_dynamic_patcher_runs_budget_on_its_non_dynamic_delegate(comfy):
    model = _node(DynamicMemoryPatcher(), "budget", 100)
    assert type(model) is MemoryPatcher
    record, _ = _prepare(model, fits=MODEL_BYTES)
    assert "non-dynamic delegate" in record["note"] and model.loaded_size() == 100 * MIB
    assert type(_node(DynamicMemoryPatcher(), "unload_after")) is DynamicMemoryPatcher


class UnreloadablePatcher(DynamicMemoryPatcher):
    """A dynamic VRAM model from a loader that left ComfyUI no way to load it again."""

    def get_non_dynamic_delegate(self):
        raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")


def test_a_dynamic_patcher_without_a_delegate_follows_on_unavailable(comfy):
    model = _node(UnreloadablePatcher(), "budget", 100)
    assert type(model) is UnreloadablePatcher, "ComfyUI's dynamic VRAM keeps streaming it"
    (record,) = patching.model_records(model.model_options)
    assert record["active"] == "no-op" and "cached_patcher_init is not initialized" in record["note"]
    assert record["short"].startswith("does nothing: ComfyUI's dynamic VRAM streams this model")
    with pytest.raises(UserError, match=r"^model: ComfyUI's dynamic VRAM streams this model .*start ComfyUI with dynamic VRAM off"):
        _node(UnreloadablePatcher(), "budget", 100, on_unavailable="error")


def test_unload_after_frees_the_model_when_the_sampler_returns(comfy):
    model = _node(MemoryPatcher(), "unload_after")
    model.loaded = MODEL_BYTES
    other = types.SimpleNamespace(model=None)
    unloaded = []
    loaded = types.SimpleNamespace(model=model, model_unload=lambda: unloaded.append(model))
    comfy.current_loaded_models[:] = [other, loaded]
    (wrapper,) = model.wrappers[WrappersMP.SAMPLER_SAMPLE][offload_node.NODE]
    guider = types.SimpleNamespace(model_patcher=model)
    run = SamplingRun("t", "cpu")
    with run.memory_scope():
        assert wrapper(lambda g, sigmas: sigmas * 2, guider, torch.ones(2)).tolist() == [2.0, 2.0]
    assert unloaded == [model] and comfy.current_loaded_models == [other] and comfy.emptied
    (record,) = [r for r in run.optimizations if r["node"] == offload_node.NODE]
    assert record["active"] == "unload_after: 1,600.0 MiB of weights freed from the device after sampling"


def test_on_a_cpu_it_is_a_no_op_or_an_error_naming_the_input(comfy):
    model = _node(MemoryPatcher("cpu"), "budget")
    assert not any(offload_node.NODE in by_key for by_key in model.wrappers.values())
    (record,) = patching.model_records(model.model_options)
    assert record["active"] == "no-op" and "CPU" in record["note"]
    assert record["short"].startswith("does nothing: "), "the report table says the node did less than asked"
    with pytest.raises(UserError, match=r"^mode: .*; set mode to none \(or set on_unavailable to fallback to pass the model through\)$"):
        _node(MemoryPatcher("cpu"), "sequential", on_unavailable="error")


def test_a_bad_mode_names_the_input():
    with pytest.raises(UserError, match="^mode: 'swap' is not one of"):
        OffloadConfig("swap")
