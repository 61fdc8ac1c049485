"""SDOptStepCache under CUDA Graph (and Compile) on a real GPU, inside ComfyUI: the full and the
shallow call are each captured once and replayed, and the latent equals the eager cached one's
(the same kernels on the same inputs: 1e-3 for cuDNN's algorithm choice; compiled: inductor's fused
fp16 kernels, 2e-2 of the largest magnitude). Full SD1.5 checkpoint, fp16, 512², 12 euler steps.
"""

import pytest
import torch

STEPS, SIZE = 12, 512
LATENT_ATOL = 1e-3
COMPILED_REL_TOL = 2e-2


def _sample(comfy, model):
    import nodes

    _, _, positive, negative = comfy
    latent = {"samples": torch.zeros(1, 4, SIZE // 8, SIZE // 8)}
    return nodes.common_ksampler(model, 42, STEPS, 7.0, "euler", "normal", positive, negative, latent)[0]["samples"]


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compile+graph"])
def test_full_and_shallow_graphs_replay_and_equal_eager(comfy, compiled):
    host, model = comfy[:2]
    node = host.node_classes
    (cached,) = node["SDOptStepCache"]().patch(model, "deepcache", 3, 0, 0.0, 1.0, "error")
    eager = _sample(comfy, cached)
    fast = cached
    if compiled:
        (fast,) = node["SDOptCompile"]().patch(fast, "compile", "inductor", "default", False, False, "error")
    (fast,) = node["SDOptCUDAGraph"]().patch(fast, 4, "error")
    for _ in range(2):
        out = _sample(comfy, fast)
        if compiled:
            assert (out - eager).abs().max().item() <= COMPILED_REL_TOL * eager.abs().max().item()
        else:
            torch.testing.assert_close(out, eager, atol=LATENT_ATOL, rtol=0)
    path = host.pack("nodes.fast_path").fast_path_of(fast)
    graph_stats = path.stats("SDOptCUDAGraph")
    assert sorted(s.captures for s in graph_stats) == [1, 1], "one graph for the full call, one for the shallow call"
    assert all(s.replays > 0 and not s.eager_calls for s in graph_stats)
    assert path.state_of("SDOptStepCache").stats.reused_calls == STEPS - STEPS // 3
