"""SDOptOffload in real ComfyUI on each family's mini checkpoint.

On this CPU-only host the node is a no-op that says so. The wrappers it installs on a GPU are run
here too, on a CPU patcher: ComfyUI's ``partially_unload`` then turns the freed layers into
cast-per-layer ("lowvram") layers without moving them, which is the same code path a GPU streams
through. Each mode must leave the stated bytes resident and sample exactly what stock samples.
"""
import pytest
import torch


@pytest.fixture
def offload(comfy_host):
    return comfy_host.pack("nodes.offload"), comfy_host.pack("optim.offload")


def _profiled(comfy_host, model):
    (profiled,) = comfy_host.nodes["SDOptProfiler"]().apply(model, "offload")
    return profiled


def _run_record(comfy_host, prompt_id):
    (record,) = [r for r in comfy_host.prompt_context.prompt_log(prompt_id).runs[-1]["optimizations"] if r["node"] == "SDOptOffload"]
    return record


def test_on_a_cpu_the_node_passes_through_and_says_so(family_host):
    model = family_host.load_checkpoint()[0]
    (patched,) = family_host.nodes["SDOptOffload"]().patch(model, "budget", 16, "fallback")
    (record,) = [r for r in family_host.patching.model_records(patched.model_options) if r["node"] == "SDOptOffload"]
    assert record["active"] == "no-op" and "CPU" in record["note"]
    assert family_host.wrapper_counts(patched, "SDOptOffload") == {}
    assert torch.equal(family_host.sample(patched), family_host.sample(model))


def test_on_a_cpu_error_names_the_input(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    user_error = comfy_host.pack("errors").UserError
    with pytest.raises(user_error, match="^mode: .*CPU"):
        comfy_host.nodes["SDOptOffload"]().patch(model, "sequential", 0, "error")
    comfy_host.nodes["SDOptOffload"]().patch(model, "none", 0, "error")


@pytest.mark.parametrize("mode", ["budget", "sequential", "none"])
def test_each_mode_keeps_its_residency_and_samples_what_stock_samples(lean_host, offload, prompt_context, mode):
    nodes_offload, optim_offload = offload
    model = lean_host.load_checkpoint()[0]
    stock = lean_host.sample(model)
    size = model.model_size()
    budget = size // 3
    patched = nodes_offload.offload_clone(model, optim_offload.OffloadConfig(mode, budget), f"mode={mode}", "error")
    out = lean_host.sample(_profiled(lean_host, patched))
    torch.testing.assert_close(out, stock, rtol=0, atol=0)
    resident = patched.loaded_size()
    if mode == "budget":
        assert 0 < resident <= budget
    elif mode == "sequential":
        # only what ComfyUI cannot cast per layer stays: tensors outside its cast-per-layer modules
        # (none in the UNets; SD3's position grid, a buffer)
        loose = sum(t.numel() * t.element_size() for m in model.model.diffusion_model.modules()
                    if not hasattr(m, "comfy_cast_weights") for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        assert resident < loose + size * 0.01
    else:
        assert resident == size
    active = _run_record(lean_host, prompt_context)["active"]
    assert active.startswith(mode) and f"{resident / 2**20:,.1f} of {size / 2**20:,.1f} MiB of weights resident" in active
    assert torch.equal(lean_host.sample(model), stock)


def test_unload_after_frees_the_weights_when_sampling_ends(family_host, offload, prompt_context):
    import comfy.model_management as mm

    nodes_offload, optim_offload = offload
    model = family_host.load_checkpoint()[0]
    stock = family_host.sample(model)
    patched = nodes_offload.offload_clone(model, optim_offload.OffloadConfig("unload_after"), "mode=unload_after", "error")
    out = family_host.sample(_profiled(family_host, patched))
    assert torch.equal(out, stock)
    assert not any(loaded.model is not None and loaded.model.is_clone(model) for loaded in mm.current_loaded_models)
    assert "MiB of weights freed from the device after sampling" in _run_record(family_host, prompt_context)["active"]
    assert torch.equal(family_host.sample(model), stock)
