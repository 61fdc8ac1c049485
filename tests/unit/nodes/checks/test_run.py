"""Every check run in order: a check that raises is one failed row and the others still run."""
from sdopt.nodes.checks import FAILED, check_cuda_graph, check_device, run_checks
from sdopt.nodes.checks import per_node, run

from .support import assert_fix, raising


def test_a_check_that_raises_is_one_failed_row_and_the_others_still_run(monkeypatch):
    def explodes(ctx):
        raise KeyError("surprise")

    monkeypatch.setattr(run, "CHECKS", (("device", check_device), ("boom", explodes), ("CUDA graph", check_cuda_graph)))
    rows = run_checks("cpu")
    assert [r.check for r in rows] == ["device", "boom", "CUDA graph"]
    assert rows[1].status == FAILED and "KeyError" in rows[1].result and "in explodes" in rows[1].result
    assert_fix(rows[1], "issues")
    assert all(r.seconds >= 0 for r in rows)


def test_a_node_check_that_raises_costs_only_its_own_rows(monkeypatch):
    (graph_and_offload,) = [group for name, group in per_node.NODE_GROUPS if "CUDA Graph" in name]
    monkeypatch.setitem(graph_and_offload, "SDOptCUDAGraph", raising("capture probe broke"))
    monkeypatch.setattr(run, "CHECKS", (("device", check_device), *per_node.NODE_CHECKS))
    rows = {r.check: r for r in run_checks("cpu")}
    assert rows["node: sdopt CUDA Graph and Offload"].status == FAILED
    assert "capture probe broke" in rows["node: sdopt CUDA Graph and Offload"].result
    for node in ("sdopt Precision", "sdopt Attention", "sdopt Compile", "sdopt Tiled VAE", "sdopt Profiler"):
        assert f"node: {node}" in rows, node
