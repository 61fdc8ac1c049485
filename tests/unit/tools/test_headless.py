"""tools.headless without ComfyUI: ComfyHost booted over fake ComfyUI modules (which PromptExecutor
arguments it passes), the stand-in server's events and failure messages, and the log of a node's
UserError kept quiet. The host tier boots the real ComfyUI."""
import enum
import logging
import sys
import traceback
import types

import pytest

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
    comfy.utils = module("comfy.utils", set_progress_bar_enabled=lambda enabled: seen.__setitem__("console_bar", enabled))
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


def test_vram_cap_fraction_and_reserve_make_comfyui_plan_for_the_cap():
    cap = headless.plan_vram_cap(8 * GiB, "H100", device_total=lambda: 80 * GiB, comfy_reserved_bytes=GiB // 2)
    assert cap.in_force and cap.fraction == pytest.approx(0.1)
    # ComfyUI sees free memory minus its reserve: 80 GiB free on the idle device leaves the cap less
    # the reserve any GPU of the cap's size would keep.
    assert 80 * GiB - cap.reserved_bytes == 8 * GiB - GiB // 2
    assert "VRAM capped at 8.00 GiB of H100's 80.00 GiB" in cap.note() and "0.100" in cap.note()


def test_vram_cap_the_size_of_the_gpu_is_the_whole_gpu():
    cap = headless.plan_vram_cap(80 * GiB, "H100", device_total=lambda: 80 * GiB)
    assert cap.fraction == 1.0 and cap.reserved_bytes == 0


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


def test_reserved_vram_is_set_where_comfyui_has_the_setting():
    old = types.SimpleNamespace(EXTRA_RESERVED_VRAM=400 * 2**20)
    old.extra_reserved_memory = lambda: old.EXTRA_RESERVED_VRAM
    assert headless.comfy_reserved_vram(old) == 400 * 2**20
    assert headless.set_comfy_reserved_vram(old, 72 * GiB) and old.extra_reserved_memory() == 72 * GiB
    function_only = types.SimpleNamespace(extra_reserved_memory=lambda: 0)
    assert headless.set_comfy_reserved_vram(function_only, GiB) and function_only.extra_reserved_memory() == GiB
    neither = types.SimpleNamespace()
    assert headless.comfy_reserved_vram(neither) == 0 and not headless.set_comfy_reserved_vram(neither, GiB)


def test_a_cap_comfyui_cannot_plan_for_says_so():
    cap = headless.VramCap(8 * GiB, "H100", 80 * GiB, comfy_plans_for_cap=False)
    assert "its model loading plans for the whole GPU" in cap.note()


def test_a_cap_under_dynamic_vram_says_what_it_does_not_bound():
    cap = headless.VramCap(8 * GiB, "H100", 80 * GiB, dynamic_vram=True)
    assert cap.note().endswith("dynamic VRAM maps weights past PyTorch's allocator, and the cap does not bound those")
