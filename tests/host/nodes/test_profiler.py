"""SDOptProfiler on a real ComfyUI model: profiling changes nothing numerically, leaves the
given model alone, and files one run per sampling with a mark per step."""
import pytest
import torch


def test_profiled_clone_samples_bit_identically_and_files_a_run(comfy_host):
    from comfy_execution.utils import CurrentNodeContext

    model = comfy_host.load_checkpoint()[0]
    records = comfy_host.pack("nodes.records")
    wrappers_before = {kind: dict(keys) for kind, keys in model.wrappers.items()}
    stock = comfy_host.sample(model)
    (profiled,) = comfy_host.nodes["SDOptProfiler"]().apply(model, "  unit  ")
    with CurrentNodeContext("test-profiler", "1"):
        out = comfy_host.sample(profiled)
    assert torch.equal(out, stock), "profiling must not change the result"
    assert {kind: dict(keys) for kind, keys in model.wrappers.items()} == wrappers_before
    assert torch.equal(comfy_host.sample(model), stock)
    (run,) = records.prompt_runs("test-profiler")
    assert run["label"] == "unit" and len(run["steps"]) == 2
    assert run["sampler_total_s"] >= sum(step["seconds"] for step in run["steps"])


def test_empty_label_is_refused(comfy_host):
    with pytest.raises(ValueError, match="'label' is empty"):
        comfy_host.nodes["SDOptProfiler"]().apply(comfy_host.load_checkpoint()[0], "   ")
