"""nodes.environment against fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes): its version, memory mode and
dynamic-VRAM probe, the memory a node may use, and the family of a patcher's model.

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import sys
import types

import pytest
import torch

from sdopt.measure.report import CLASSIC_MEMORY, DYNAMIC_VRAM
from sdopt.nodes import environment

from .comfy_fakes import SD15, SSD1B, AuraFlow, FastPatcher, install

pytestmark = pytest.mark.usefixtures("no_comfyui")


def test_comfyui_version_without_comfyui():
    assert environment.comfyui_version() is None


def test_memory_mode_names_dynamic_vram_and_when_a_server_would_differ(monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy.memory_management", types.ModuleType("comfy.memory_management"))
    assert environment.memory_mode("cuda:0") == (None, ""), "a ComfyUI without dynamic VRAM"
    sys.modules["comfy.memory_management"].aimdo_enabled = True
    assert environment.memory_mode("cuda:0") == (DYNAMIC_VRAM, "")
    sys.modules["comfy.memory_management"].aimdo_enabled = False
    monkeypatch.setitem(sys.modules, "comfy_aimdo", types.ModuleType("comfy_aimdo"))
    args = types.SimpleNamespace(disable_dynamic_vram=False)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", types.SimpleNamespace(args=args))
    assert environment.memory_mode("cuda:0") == (CLASSIC_MEMORY, ""), "off without being told: as a server here would be"
    args.disable_dynamic_vram = True  # --disable-dynamic-vram, or the headless runner's --memory-mode classic
    mode, note = environment.memory_mode("cuda:0")
    assert mode == CLASSIC_MEMORY and note.startswith("dynamic VRAM turned off (--disable-dynamic-vram or --memory-mode classic)")
    assert environment.memory_mode("cpu") == (CLASSIC_MEMORY, ""), "no server turns it on for a CPU"
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)
    assert environment.memory_mode("cuda:0") == (CLASSIC_MEMORY, ""), "nor without comfy-aimdo"



def test_dynamic_vram_probe_takes_off_what_pytorch_holds_on_every_gpu(monkeypatch):
    install(monkeypatch, "comfy.memory_management", aimdo_enabled=True)
    install(monkeypatch, "comfy_aimdo.control", get_total_vram_usage=lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**30)  # counted by aimdo's hook too
    assert environment.dynamic_vram_probe("cuda:0")() == 2 * 2**30
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4 * 2**30)
    assert environment.dynamic_vram_probe("cuda:0")() == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # aimdo's total is every GPU's
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**30)
    assert environment.dynamic_vram_probe("cuda:0")() == 2**30
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)  # enabled, but the package cannot be imported
    assert environment.dynamic_vram_probe("cuda:0") is None


# --- the model's family -------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class,label,known", [(SD15, "SD1.5", True), (SSD1B, "SDXL", True), (AuraFlow, "family unknown (AuraFlow)", False)])
def test_model_family_comes_from_comfyuis_config_class(config_class, label, known):
    family = environment.model_family(FastPatcher(config_class))
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

    family = environment.model_family(types.SimpleNamespace(model=CustomModel()))
    assert family.family is None and family.label == "family unknown (CustomModel)"


def test_free_for_work_leaves_comfyuis_reserved_vram(monkeypatch):
    install(monkeypatch, "comfy.model_management", extra_reserved_memory=lambda: 600 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    assert environment.free_for_work(torch.device("cuda", 0)) == (4 << 30) - (600 << 20)
    sys.modules["comfy.model_management"].get_free_memory = lambda device: 4 << 30
    streaming = types.SimpleNamespace(get_free_memory=lambda device: 7 << 30)  # 0.38: plus 3 GiB its streamed weights give back
    assert environment.free_for_work(torch.device("cuda", 0), streaming) == (7 << 30) - (600 << 20)
    assert environment.free_for_work(torch.device("cuda", 0), types.SimpleNamespace()) == (4 << 30) - (600 << 20), "0.3.x patchers"
    # host memory has no VRAM reserve
    from sdopt.optim.device import free_memory
    assert abs(environment.free_for_work(torch.device("cpu")) - free_memory("cpu")) < 256 << 20
