"""tools.headless without ComfyUI: ComfyHost booted over fake ComfyUI modules (which PromptExecutor
arguments it passes), the stand-in server's events and failure messages, and the log of a node's
UserError kept quiet. The host tier boots the real ComfyUI."""
import enum
import logging
import sys
import traceback
import types

import pytest
import torch

from sdopt.errors import UserError
from sdopt.nodes import prompt_context
from sdopt.tools import headless


class CacheType(enum.Enum):
    CLASSIC = 0
    LRU = 1


class Executor0375:
    """0.3.75 and newer: the server passes ``cache_args``."""

    def __init__(self, server, cache_type=False, cache_args=None):
        self.server, self.cache_type, self.cache_args = server, cache_type, cache_args


class Executor0364:
    """0.3.64: no ``cache_args``."""

    def __init__(self, server, cache_type=False, cache_size=None):
        self.server, self.cache_type, self.cache_size = server, cache_type, cache_size


def _fake_comfyui(monkeypatch, executor, loaded=True):
    """The modules ``ComfyHost`` imports, as fakes; returns what they saw."""
    seen = {"args_parsing": 0, "argv": None}

    def module(name, **attrs):
        fake = types.ModuleType(name)
        fake.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, fake)
        return fake

    def enable_args_parsing():
        seen["args_parsing"] += 1
        seen["argv"] = list(sys.argv)

    async def init_extra_nodes(init_custom_nodes=True, init_api_nodes=True):
        seen["extra_nodes"] = (init_custom_nodes, init_api_nodes)

    async def load_custom_node(path):
        seen["custom_node"] = path
        if loaded:
            nodes.NODE_CLASS_MAPPINGS[headless.REPORT_NODE] = object
        return loaded

    comfy = module("comfy")
    comfy.__path__ = []
    comfy.options = module("comfy.options", enable_args_parsing=enable_args_parsing)
    comfy.cli_args = module("comfy.cli_args", args=types.SimpleNamespace())  # a ComfyUI without dynamic VRAM
    comfy.utils = module("comfy.utils", set_progress_bar_enabled=lambda enabled: seen.__setitem__("console_bar", enabled),
                         set_progress_bar_global_hook=lambda hook: seen.__setitem__("progress_hook", hook))
    module("utils")
    module("execution", PromptExecutor=executor, CacheType=CacheType)
    module("folder_paths")
    nodes = module("nodes", NODE_CLASS_MAPPINGS={}, init_extra_nodes=init_extra_nodes, load_custom_node=load_custom_node)
    server = module("server", PromptServer=types.SimpleNamespace(instance=None))
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen["server"] = server
    return seen


@pytest.mark.parametrize(
    ("executor", "options"),
    [(Executor0375, {"cache_args": headless.CACHE_ARGS}), (Executor0364, {})],
    ids=["0.3.75+", "0.3.64"],
)
def test_host_passes_cache_args_where_the_executor_takes_them(monkeypatch, tmp_path, executor, options):
    seen = _fake_comfyui(monkeypatch, executor)
    argv = list(sys.argv)
    host = headless.ComfyHost(tmp_path)
    made = host._executor
    assert type(made) is executor and made.server is host._server and made.cache_type is CacheType.CLASSIC
    if options:
        assert made.cache_args == {"lru": 0, "ram": 0, "ram_inactive": 0}
    else:
        assert made.cache_size is None
    assert seen["args_parsing"] == 1 and seen["argv"][0] == "main.py" and sys.argv == argv
    assert seen["extra_nodes"] == (False, False) and seen["custom_node"] == str(headless.PACK_ROOT)
    assert sys.path[0] == str(tmp_path)
    assert seen["server"].PromptServer.instance is host._server, "the stand-in server is ComfyUI's server"
    assert seen["console_bar"] is sys.stderr.isatty(), "ComfyUI's console bar only on a terminal"
    assert host.memory_mode.dynamic is None, "these fakes are a ComfyUI without dynamic VRAM"


def test_progress_bar_updates_reach_comfyuis_progress_registry_as_in_a_server(monkeypatch, tmp_path):
    seen = _fake_comfyui(monkeypatch, Executor0375)
    updates, executing = [], types.SimpleNamespace(node_id="3")
    registry = types.SimpleNamespace(update_progress=lambda *args: updates.append(args))
    for name, attrs in (("comfy_execution", {}), ("comfy_execution.progress", {"get_progress_state": lambda: registry}),
                        ("comfy_execution.utils", {"get_executing_context": lambda: executing})):
        fake = types.ModuleType(name)
        fake.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, fake)
    headless.ComfyHost(tmp_path)
    hook = seen["progress_hook"]
    hook(2, 20, None)
    hook(3, 20, "preview", node_id="7")
    executing = None
    hook(4, 20, None)
    assert updates == [("3", 2, 20, None), ("7", 3, 20, "preview")], "the executing node's, or the one named; none outside a node"


def test_host_refuses_a_comfyui_that_did_not_load_the_pack(monkeypatch, tmp_path):
    _fake_comfyui(monkeypatch, Executor0375, loaded=False)
    with pytest.raises(RuntimeError, match="could not load sdopt"):
        headless.ComfyHost(tmp_path)


def test_server_starts_the_node_timer_with_each_prompt(monkeypatch):
    started = []
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda prompt_id, node=None: started.append(prompt_id))
    server = headless._Server()
    server.send_sync("execution_start", {"prompt_id": "p"})
    server.send_sync("execution_cached", {"prompt_id": "p", "nodes": []})
    server.send_sync(headless.REPORT_EVENT, {"report": {"x": 1}})
    assert started == ["p"]
    assert server.reports() == [{"report": {"x": 1}}]


def test_failure_messages(monkeypatch):
    host = headless.ComfyHost.__new__(headless.ComfyHost)
    host._server = headless._Server()
    assert host._failure_message() == "the workflow failed (see ComfyUI's log above)"
    host._server.events.append(("execution_interrupted", {"node_id": "4", "node_type": "KSampler"}))
    assert host._failure_message() == "the run was interrupted at node 4 (KSampler)"
    host._server.events.append(("execution_error", {"node_id": "9", "node_type": "SDOptPrecision",
                                                    "exception_type": "sdopt.UserError", "exception_message": "weight_dtype: no\n"}))
    assert host._failure_message() == "node 9 (SDOptPrecision): weight_dtype: no", "a mistake reads as its one line"
    host._server.events.append(("execution_error", {"node_id": "3", "node_type": "KSampler",
                                                    "exception_type": "RuntimeError", "exception_message": "shape mismatch\n"}))
    assert host._failure_message() == "node 3 (KSampler) failed: RuntimeError: shape mismatch"


class PackUserError(Exception):
    """The pack's UserError as ComfyUI loads it: a class of its own, apart from ``sdopt.errors``'."""


@pytest.mark.parametrize("error,logged", [(UserError("x: bad"), False), (PackUserError("x: bad"), False), (RuntimeError("crash"), True)])
def test_comfyuis_log_of_a_node_error_is_quiet_for_user_errors_only(caplog, error, logged):
    with headless._quiet_user_errors((UserError, PackUserError)):
        try:
            raise error
        except Exception:
            logging.error("!!! Exception during processing !!!")
            logging.error(traceback.format_exc())
    assert bool(caplog.records) is logged
    assert ("Traceback" in caplog.text) is logged
    logging.error("after the run")
    assert "after the run" in caplog.text, "the filter goes with the run"


GiB = 2**30


def test_vram_cap_fraction_is_the_cap_over_the_device():
    cap = headless.plan_vram_cap(8 * GiB, "H100", device_total=lambda: 80 * GiB)
    assert cap.in_force and cap.fraction == pytest.approx(0.1)
    assert "VRAM capped at 8.00 GiB of H100's 80.00 GiB" in cap.note() and "0.100" in cap.note()
    assert "ComfyUI's free memory stays within it" in cap.note()


def test_vram_cap_the_size_of_the_gpu_is_the_whole_gpu():
    assert headless.plan_vram_cap(80 * GiB, "H100", device_total=lambda: 80 * GiB).fraction == 1.0


def _comfy_free_memory(free_total, free_torch):
    """ComfyUI's get_free_memory signature, answering for an idle big GPU and for the CPU."""
    def get_free_memory(dev=None, torch_free_too=False):
        answer = (100 * GiB, 0) if dev is not None and torch.device(dev).type == "cpu" else (free_total, free_torch)
        return answer if torch_free_too else answer[0]
    return get_free_memory


def test_capped_free_memory_answers_as_a_gpu_of_the_caps_size():
    live = {"bytes": GiB}
    capped = headless.capped_free_memory(_comfy_free_memory(135 * GiB, GiB // 4), 4 * GiB, "cuda:0", lambda device: live["bytes"])
    # what ComfyUI's checkpoint loader asks before building a model on the GPU: the cap less live tensors
    assert capped("cuda:0") == 3 * GiB and capped() == 3 * GiB and capped(torch.device("cuda")) == 3 * GiB
    assert capped("cuda:0", torch_free_too=True) == (3 * GiB, GiB // 4)
    live["bytes"] = 5 * GiB
    assert capped("cuda:0") == 0 and capped("cuda:0", torch_free_too=True) == (0, 0)
    assert capped("cpu") == 100 * GiB, "host memory is not capped"
    assert capped("cuda:1") == 135 * GiB, "only the capped GPU"


def test_capped_free_memory_never_reports_more_than_the_device_has():
    capped = headless.capped_free_memory(_comfy_free_memory(2 * GiB, 0), 8 * GiB, "cuda:0", lambda device: 0)
    assert capped("cuda:0") == 2 * GiB and capped.uncapped("cuda:0") == 2 * GiB


def test_vram_cap_without_cuda_is_ignored_with_one_line():
    cap = headless.plan_vram_cap(8 * GiB, "cpu")
    assert not cap.in_force
    assert cap.note() == "--vram-cap 8.00 GiB ignored: the cap applies to CUDA GPUs only, and this run is on cpu"


def test_vram_cap_larger_than_the_gpu_names_the_option():
    with pytest.raises(headless.UserError, match=r"--vram-cap 96.00 GiB is more than H100's 80.00 GiB: give a smaller size"):
        headless.plan_vram_cap(96 * GiB, "H100", device_total=lambda: 80 * GiB)


def test_vram_cap_parses_sizes_and_names_the_option():
    assert headless.parse_vram_cap("6000MiB") == 6000 * 2**20 and headless.parse_vram_cap(None) is None
    with pytest.raises(headless.UserError, match="--vram-cap: 'lots' is not a size"):
        headless.parse_vram_cap("lots")


def test_a_cap_comfyui_cannot_plan_for_says_so():
    cap = headless.VramCap(8 * GiB, "H100", 80 * GiB, comfy_plans_for_cap=False)
    assert "its model loading plans for the whole GPU" in cap.note()


def test_a_cap_under_dynamic_vram_says_what_it_does_not_bound():
    cap = headless.VramCap(8 * GiB, "H100", 80 * GiB, dynamic_vram=True)
    assert cap.note().endswith("dynamic VRAM maps weights past PyTorch's allocator, and the cap does not bound those")


def test_memory_mode_text_names_the_mode_that_started_or_the_one_asked_for(monkeypatch):
    from sdopt.tools.memory_mode import ENVIRONMENT, MemoryMode

    monkeypatch.setattr(headless, "_host", None)
    monkeypatch.setenv(ENVIRONMENT, "classic")
    assert headless.memory_mode_text() == "--memory-mode classic", "nothing booted yet"
    host = types.SimpleNamespace(memory_mode=MemoryMode("auto", True, "on"))
    monkeypatch.setattr(headless, "_host", host)
    assert headless.memory_mode_text() == "dynamic VRAM"
    host.memory_mode = MemoryMode("auto", None, "this ComfyUI has no dynamic VRAM")
    assert headless.memory_mode_text() == "a ComfyUI without dynamic VRAM"
