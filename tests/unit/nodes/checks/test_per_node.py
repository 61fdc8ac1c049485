"""The doctor's rows about sdopt's nodes: one per node of nodes/registry.py, each saying which modes run on
this device and why the others do not, read from the techniques' own checks and the trials before them."""
import pytest

from sdopt.nodes import registry
from sdopt.nodes.checks import FAILED, OK, UNAVAILABLE, WARN, CheckRow, check_nodes, require_rows
from sdopt.nodes.checks import per_node
from sdopt.optim.compile import config as compile_config

from .support import assert_fix, ctx, one

NODES = ["sdopt Precision", "sdopt VAE Precision", "sdopt Attention", "sdopt VAE Attention", "sdopt Compile", "sdopt CUDA Graph",
         "sdopt Offload", "sdopt Auto", "sdopt Tiled VAE", "sdopt Low Memory", "sdopt Step Cache", "sdopt Profiler", "sdopt Profile Report"]


def test_nodes_on_a_cpu_say_which_modes_run_and_why_the_others_do_not(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: "/usr/bin/g++")
    rows = {r.check.removeprefix("node: "): r for r in check_nodes(ctx())}
    assert list(rows) == NODES
    for name in ("sdopt VAE Precision", "sdopt Tiled VAE", "sdopt Low Memory", "sdopt Step Cache", "sdopt Profiler"):
        assert rows[name].status == OK, rows[name]
    assert "auto → float32 (faked pick)" in rows["sdopt Precision"].result
    assert rows["sdopt Precision"].status == WARN and "tf32" in rows["sdopt Precision"].result
    assert "compile and compile_regional with inductor, aot_eager, eager" in rows["sdopt Compile"].result
    assert_fix(rows["sdopt Compile"], "pick backend inductor")
    assert_fix(rows["sdopt CUDA Graph"], "NVIDIA GPU")
    assert rows["sdopt CUDA Graph"].status == UNAVAILABLE
    assert rows["sdopt Offload"].status == UNAVAILABLE
    assert_fix(rows["sdopt Offload"], "already in RAM")
    assert rows["sdopt Auto"].status == OK and "for a UNet here: Compile(compile)" in rows["sdopt Auto"].result


def test_compile_node_without_a_compiler_or_after_a_failed_inductor_trial(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: None)
    row = one(check_nodes(ctx()), "node: sdopt Compile")
    assert "backend inductor (inductor on a CPU needs a C++ compiler" in row.result and "trace" in row.result
    assert_fix(row, "install g++ or clang++")
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: "/usr/bin/g++")
    context = ctx()
    context.rows["inductor"] = CheckRow("inductor", "tried", FAILED, "the compile failed: CppCompileError", "fix")
    row = one(check_nodes(context), "node: sdopt Compile")
    assert "backend inductor (the inductor trial: the compile failed" in row.result
    assert_fix(row, "inductor row")


def test_report_node_without_matplotlib(monkeypatch):
    real = per_node.importlib.util.find_spec
    monkeypatch.setattr(per_node.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    row = one(check_nodes(ctx()), "node: sdopt Profile Report")
    assert row.status == WARN
    assert_fix(row, "pip install matplotlib")


def test_attention_node_leaves_out_a_backend_whose_trial_failed():
    context = ctx()
    context.rows["attention: sliced"] = CheckRow("attention: sliced", "tried", FAILED, "raised RuntimeError: boom", "fix")
    row = one(check_nodes(context), "node: sdopt Attention")
    assert "sliced (raised RuntimeError: boom)" in row.result and ", sliced," not in row.result


# --- every registered node has its row ------------------------------------------------------------


def test_every_registered_node_has_a_row_in_the_tables_order():
    require_rows(registry.NODE_CLASS_MAPPINGS)
    titles = [registry.NODE_DISPLAY_NAME_MAPPINGS[node] for node in per_node.NODE_ROWS]
    assert titles == NODES


def test_a_registered_node_without_a_row_is_named(monkeypatch):
    monkeypatch.setitem(registry.NODE_CLASS_MAPPINGS, "SDOptFake", type("SDOptFake", (), {}))
    with pytest.raises(LookupError, match=r"^SDOptFake registered in nodes/registry.py without a doctor row: give each a row builder"):
        require_rows(registry.NODE_CLASS_MAPPINGS)


def test_a_row_of_a_node_no_longer_registered_is_named(monkeypatch):
    monkeypatch.delitem(registry.NODE_CLASS_MAPPINGS, "SDOptProfiler")
    with pytest.raises(LookupError, match=r"^SDOptProfiler not registered in nodes/registry.py"):
        require_rows(registry.NODE_CLASS_MAPPINGS)
