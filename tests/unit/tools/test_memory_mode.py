"""tools.memory_mode over fake ComfyUI and comfy-aimdo modules: ComfyUI's own start-up decisions
(main.py) for auto, classic and dynamic, each comfy-aimdo protocol, and a refusal with its reason and
fix wherever dynamic VRAM cannot start. The host tier runs it in a real ComfyUI (on a CPU: classic)."""
import sys
import types

import pytest
import torch

from sdopt.errors import UserError
from sdopt.nodes.environment import NO_AIMDO, NO_CUDA, NOT_OFFERED, server_would_start
from sdopt.tools import memory_mode
from sdopt.tools.memory_mode import AUTO, CLASSIC, DYNAMIC, MemoryModeStart


class Aimdo:
    """comfy_aimdo.control; ``protocol`` is the comfy-aimdo release whose signatures it has."""

    def __init__(self, protocol="0.4.13", loads=True, takes_devices=True):
        self.protocol, self.loads, self.takes_devices = protocol, loads, takes_devices
        self.init_calls, self.device_calls, self.log = [], [], None

    def init(self, **options):
        allowed = {"0.4.13": {"simple_vram_headroom", "nvml_pressure"}, "0.4.10": {"simple_vram_headroom"}, "0.4.9": set()}
        if set(options) - allowed[self.protocol]:
            raise TypeError(f"init() got an unexpected keyword argument {sorted(set(options) - allowed[self.protocol])[0]!r}")
        self.init_calls.append(options)
        return self.loads

    def init_devices(self, device_ids):
        device_ids = list(device_ids)
        if self.protocol == "0.4.9" and any(isinstance(entry, tuple) for entry in device_ids):
            raise TypeError("an integer is required")
        self.device_calls.append(device_ids)
        return self.takes_devices

    def set_log_info(self):
        self.log = "info"


@pytest.fixture
def comfy(monkeypatch):
    """Fake ComfyUI modules as a 0.38 main.py finds them on an NVIDIA GPU; change attributes to vary."""

    def module(name, **attrs):
        fake = types.ModuleType(name)
        fake.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, fake)
        return fake

    args = types.SimpleNamespace(enable_dynamic_vram=False, disable_dynamic_vram=False, highvram=False, gpu_only=False,
                                 novram=False, cpu=False, reserve_vram=None, vram_headroom=0, disable_nvml_pressure=False)

    def enables_dynamic_vram():
        if args.enable_dynamic_vram:
            return True
        return not (args.disable_dynamic_vram or args.highvram or args.gpu_only or args.novram or args.cpu)

    class ModelPatcher:
        pass

    class ModelPatcherDynamic(ModelPatcher):
        pass

    fakes = types.SimpleNamespace(args=args, aimdo=Aimdo(), ModelPatcher=ModelPatcher, ModelPatcherDynamic=ModelPatcherDynamic)
    fakes.cli_args = module("comfy.cli_args", args=args, enables_dynamic_vram=enables_dynamic_vram)
    fakes.mm = module("comfy.model_management", is_nvidia=lambda: True, is_amd=lambda: False, rocm_version=(0, 0),
                      torch_version_numeric=(2, 11), get_all_torch_devices=lambda: [torch.device("cuda", 0)])
    fakes.patchers = module("comfy.model_patcher", CoreModelPatcher=ModelPatcher, ModelPatcherDynamic=ModelPatcherDynamic)
    fakes.memory = module("comfy.memory_management", aimdo_enabled=False)
    module("comfy_aimdo")
    monkeypatch.setitem(sys.modules, "comfy_aimdo.control", fakes.aimdo)
    return fakes


def _start(requested, cuda=True):
    start = MemoryModeStart(requested, cuda)
    start.load_library()
    return start.take_devices()


def _classic_left_alone(comfy):
    assert comfy.patchers.CoreModelPatcher is comfy.ModelPatcher and comfy.memory.aimdo_enabled is False
    assert comfy.aimdo.device_calls == []


@pytest.mark.parametrize("requested", [AUTO, DYNAMIC])
def test_dynamic_vram_starts_as_comfyuis_main_starts_it(comfy, requested):
    comfy.args.reserve_vram, comfy.args.vram_headroom = 1.5, 0.5
    mode = _start(requested)
    assert mode.dynamic is True and mode.requested == requested
    assert comfy.aimdo.init_calls == [{"simple_vram_headroom": int(1.5 * 2**30), "nvml_pressure": True}]
    assert comfy.aimdo.device_calls == [[(0, 2**29)]]
    assert comfy.patchers.CoreModelPatcher is comfy.ModelPatcherDynamic and comfy.memory.aimdo_enabled is True
    assert comfy.aimdo.log == "info", "ComfyUI's default log level, as main.py sets it"


@pytest.mark.parametrize(("protocol", "init_call", "devices"), [
    ("0.4.10", {"simple_vram_headroom": None}, [[(0, 0)]]),
    ("0.4.9", {}, [[0]]),
])
def test_older_comfy_aimdo_protocols(comfy, protocol, init_call, devices):
    comfy.aimdo.protocol = protocol
    assert _start(AUTO).dynamic is True
    assert comfy.aimdo.init_calls == [init_call] and comfy.aimdo.device_calls == devices


def test_classic_is_comfyuis_disable_flag_and_loads_nothing(comfy):
    mode = _start(CLASSIC)
    assert mode.dynamic is False and "--memory-mode classic" in mode.why
    assert comfy.args.disable_dynamic_vram is True, "so the report can say it was turned off"
    assert comfy.aimdo.init_calls == []
    _classic_left_alone(comfy)


@pytest.mark.parametrize(("vary", "why"), [
    (lambda c: setattr(c.args, "highvram", True), "off by ComfyUI's settings"),
    (lambda c: (setattr(c.mm, "is_nvidia", lambda: False), setattr(c.mm, "is_amd", lambda: True),
                setattr(c.mm, "rocm_version", (7, 2))), "not one that ComfyUI manages"),
    (lambda c: setattr(c.mm, "torch_version_numeric", (2, 7)), "PyTorch older than 2.8"),
    (lambda c: setattr(c.aimdo, "loads", False), "could not load its library"),
    (lambda c: setattr(c.aimdo, "takes_devices", False), "could not take this GPU"),
])
def test_auto_stays_classic_where_a_server_would(comfy, vary, why):
    vary(comfy)
    mode = _start(AUTO)
    assert mode.dynamic is False and why in mode.why
    assert comfy.patchers.CoreModelPatcher is comfy.ModelPatcher and comfy.memory.aimdo_enabled is False


def test_auto_starts_on_a_new_enough_rocm(comfy):
    comfy.mm.is_nvidia, comfy.mm.is_amd, comfy.mm.rocm_version = (lambda: False), (lambda: True), (7, 14)
    assert _start(AUTO).dynamic is True


def test_dynamic_overrides_the_checks_enable_dynamic_vram_overrides(comfy):
    comfy.mm.torch_version_numeric = (2, 7)
    assert _start(DYNAMIC).dynamic is True and comfy.args.enable_dynamic_vram is True


@pytest.mark.parametrize(("vary", "reason", "fix"), [
    (lambda c: delattr(c.cli_args, "enables_dynamic_vram"), "this ComfyUI has no dynamic VRAM", "use a ComfyUI that offers it"),
    (lambda c: sys.modules.__setitem__("comfy_aimdo.control", None), "comfy-aimdo is not installed", "install comfy-aimdo"),
    (lambda c: setattr(c.aimdo, "loads", False), "could not load its library", "install comfy-aimdo"),
    (lambda c: setattr(c.aimdo, "takes_devices", False), "could not take this GPU", "for this driver"),
])
def test_dynamic_refuses_with_the_reason_and_a_fix(comfy, vary, reason, fix):
    vary(comfy)
    with pytest.raises(UserError, match="--memory-mode") as refused:
        _start(DYNAMIC)
    assert reason in str(refused.value) and fix in str(refused.value)
    assert comfy.memory.aimdo_enabled is False


def test_without_cuda_auto_is_classic_and_dynamic_refused(comfy):
    mode = _start(AUTO, cuda=False)
    assert mode.dynamic is False and "no CUDA device" in mode.why and comfy.aimdo.init_calls == []
    _classic_left_alone(comfy)
    with pytest.raises(UserError, match="dynamic: there is no CUDA device.*run it on an NVIDIA GPU"):
        _start(DYNAMIC, cuda=False)


def test_a_comfyui_without_dynamic_vram_has_no_mode_to_choose(comfy):
    del comfy.cli_args.enables_dynamic_vram
    for requested in (AUTO, CLASSIC):
        mode = _start(requested)
        assert mode.dynamic is None and mode.why == "this ComfyUI has no dynamic VRAM"
    _classic_left_alone(comfy)


def test_the_mode_asked_for(monkeypatch):
    monkeypatch.delenv(memory_mode.ENVIRONMENT, raising=False)
    assert memory_mode.requested_mode() == AUTO
    monkeypatch.setenv(memory_mode.ENVIRONMENT, CLASSIC)
    assert memory_mode.requested_mode() == CLASSIC
    assert memory_mode.requested_mode(DYNAMIC) == DYNAMIC, "the option wins over the environment"
    monkeypatch.setenv(memory_mode.ENVIRONMENT, "lowvram")
    with pytest.raises(UserError, match=r"\$SDOPT_MEMORY_MODE\): 'lowvram' is not a memory mode; give one of auto, dynamic, classic"):
        memory_mode.requested_mode()


def test_what_a_server_would_do_here_is_the_same_decision(comfy, monkeypatch):
    """``sdopt doctor`` asks without starting anything: the reasons are auto's."""
    assert server_would_start(cuda=True) == (True, "")
    assert server_would_start(cuda=False) == (False, NO_CUDA)
    comfy.mm.torch_version_numeric = (2, 7)
    kept_off = server_would_start(cuda=True)
    assert comfy.aimdo.init_calls == [], "nothing was started by asking"
    assert kept_off == (False, _start(AUTO).why)
    monkeypatch.setitem(sys.modules, "comfy_aimdo", None)
    assert server_would_start(cuda=True) == (False, NO_AIMDO)
    comfy.args.novram = True
    assert server_would_start(cuda=True)[1].startswith("off by ComfyUI's settings")
    del comfy.cli_args.enables_dynamic_vram
    assert server_would_start(cuda=True) == (None, NOT_OFFERED)
