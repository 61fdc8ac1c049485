"""SDOptCUDAGraph in real ComfyUI on each family's mini checkpoint, on this CPU-only host: the node passes
the model through with its reason in the record, or stops naming its input; tests/gpu runs the graphs."""
import pytest
import torch


def test_on_a_cpu_the_node_passes_through_and_says_so(family_host):
    model = family_host.load_checkpoint()[0]
    (patched,) = family_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "fallback")
    records = family_host.pack("nodes.patching").model_records(patched.model_options)
    (record,) = [r for r in records if r["node"] == "SDOptCUDAGraph"]
    assert record["active"] == "eager" and "CUDA graphs need a CUDA device" in record["note"]
    assert record["short"].startswith("runs eager: CUDA graphs need a CUDA device")
    assert family_host.pack("nodes.fast_path").fast_path_of(patched) is None


def test_on_a_cpu_the_passed_model_samples_what_stock_samples(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    (patched,) = comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "fallback")
    assert torch.equal(comfy_host.sample(patched), comfy_host.sample(model))


def test_on_a_cpu_error_names_the_input(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    with pytest.raises(comfy_host.pack("errors").UserError, match="^on_unavailable: CUDA graphs need a CUDA device"):
        comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "error")
