"""The doctor's look at ComfyUI, over fake ComfyUI modules: its version and APIs, its memory mode as a
running server has it or as a server started here would, and sdopt's compile cache listed and written to."""
import json
import sys
import types

import pytest
import torch

from sdopt.nodes.checks import FAILED, OK, UNAVAILABLE, WARN, ComfyInfo, Context, check_comfyui, check_compile_cache, check_nodes, comfyui_info
from sdopt.nodes.checks import comfyui as comfyui_checks
from sdopt.optim.compile import cache as compile_cache

from .support import assert_fix, ctx, one


# --- ComfyUI --------------------------------------------------------------------------------------


def test_comfyui_found_with_every_api_and_classic_memory():
    rows = check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.3.75")))
    assert [r.status for r in rows] == [OK, OK]
    assert "0.3.75 at /opt/ComfyUI" in rows[0].result and "no dynamic VRAM" in rows[1].result


def test_comfyui_missing_broken_or_too_old():
    assert_fix(one(check_comfyui(ctx()), "ComfyUI"), "--comfyui", "COMFYUI_PATH")
    broken = one(check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.38.1", error="ModuleNotFoundError: No module named 'comfy_aimdo'"))), "ComfyUI")
    assert broken.status == FAILED and "comfy_aimdo" in broken.result
    assert_fix(broken, "requirements.txt")
    old = one(check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.3.40", ("per-model attention override (0.3.60+)",)))), "ComfyUI")
    assert old.status == FAILED and "attention override" in old.result
    assert_fix(old, "0.3.64")


def _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled: bool):
    """The modules a ComfyUI 0.38 server has imported, with what sdopt looks for, and its version file."""
    wrappers = types.SimpleNamespace(**{name: name.lower() for name in ("DIFFUSION_MODEL", "OUTER_SAMPLE", "SAMPLER_SAMPLE", "APPLY_MODEL", "PREPARE_SAMPLING")})
    patcher = type("ModelPatcher", (), {name: None for name in ("add_wrapper_with_key", "partially_unload", "partially_load")})
    modules = {
        "comfy.ldm.modules.attention": types.SimpleNamespace(wrap_attn=lambda f: f),
        "comfy.model_patcher": types.SimpleNamespace(ModelPatcher=patcher),
        "comfy.patcher_extension": types.SimpleNamespace(WrappersMP=wrappers),
        "comfy.memory_management": types.SimpleNamespace(aimdo_enabled=aimdo_enabled),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "comfyui_version.py").write_text('# generated\n__version__ = "0.38.1"\n')


def test_comfyui_038_with_dynamic_vram_on_warns_with_the_flag_that_turns_it_off(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=True)
    info = comfyui_info(tmp_path, in_server=True)
    assert info.version == "0.38.1" and info.missing_apis == () and info.dynamic_vram is True
    api, mode = check_comfyui(ctx(info))
    assert api.status == OK
    assert mode.status == WARN and "dynamic VRAM (comfy-aimdo) is on" in mode.result
    assert_fix(mode, "--disable-dynamic-vram", "non-dynamic delegate")


def test_comfyui_038_with_dynamic_vram_off(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    mode = one(check_comfyui(ctx(comfyui_info(tmp_path, in_server=True))), "ComfyUI memory mode")
    assert mode.status == OK and "offers dynamic VRAM, and it is off" in mode.result


@pytest.mark.parametrize(("nvidia", "status", "says"), [
    (True, WARN, "a server (main.py) on this GPU turns it on by default"),
    (False, OK, "stays off here (this GPU is not one that ComfyUI manages with dynamic VRAM)"),
])
def test_comfyui_038_from_the_cli_says_what_a_server_would_do_on_this_gpu(monkeypatch, tmp_path, nvidia, status, says):
    """The CLI imports ComfyUI without starting it: the row gives the start-up decision of ``sdopt run``."""
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", types.SimpleNamespace(enables_dynamic_vram=lambda: True))
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.SimpleNamespace(is_nvidia=lambda: nvidia, torch_version_numeric=(2, 11)))
    monkeypatch.setitem(sys.modules, "comfy_aimdo", types.ModuleType("comfy_aimdo"))
    cuda = Context(torch.device("cuda", 0), comfyui_info(tmp_path, in_server=False))
    mode = one(check_comfyui(cuda), "ComfyUI memory mode")
    assert mode.status == status and says in mode.result
    on_cpu = one(check_comfyui(ctx(comfyui_info(tmp_path, in_server=False))), "ComfyUI memory mode")
    assert on_cpu.status == OK and "stays off here (no CUDA device" in on_cpu.result


def test_comfyui_apis_missing_from_the_imported_modules(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", types.SimpleNamespace())
    info = comfyui_info(tmp_path, in_server=True)
    assert info.missing_apis == ("per-model attention override (0.3.60+)",)
    node = one(check_nodes(ctx(info)), "node: sdopt Attention")
    assert node.status == UNAVAILABLE
    assert_fix(node, "0.3.60")


# --- compile cache --------------------------------------------------------------------------------


def test_compile_cache_lists_sdopts_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path))
    entry = tmp_path / "abc-torch-compile"
    entry.mkdir()
    (entry / "meta.json").write_text(json.dumps({"written_by": compile_cache.WRITTEN_BY, "key": entry.name}))
    (entry / "graph.bin").write_bytes(b"x" * 2**20)
    (tmp_path / "someone-elses").mkdir()
    row = one(check_compile_cache(ctx()), "compile cache")
    assert row.status == OK and f"{tmp_path}: 1 entry, 1.0 MiB" in row.result and "1 other item" in row.result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc-torch-compile", "someone-elses"], "the probe file is gone"


def test_compile_cache_that_cannot_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path / "cache"))

    def read_only(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(comfyui_checks, "_write_probe", read_only)
    row = one(check_compile_cache(ctx()), "compile cache")
    assert row.status == FAILED and "Permission denied" in row.result
    assert_fix(row, "SDOPT_CACHE_DIR")
