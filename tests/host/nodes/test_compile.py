"""SDOptCompile and SDOptCUDAGraph in real ComfyUI, on the mini SD1.5 checkpoint (CPU, fp32).

Sampling is ComfyUI's own KSampler path (2 euler steps at 64x64, CFG 7). A compiled clone must give
the stock latent within ``REL_TOL`` of its largest magnitude (inductor reorders fp32 reductions;
trace and aot_eager run the eager kernels), must not recompile when steps or seed change, and must
follow a LoRA loaded downstream through the stock LoraLoaderModelOnly at every strength, also over
channels-last conv weights (Precision's channels_last), whose layout the LoRA must keep.
"""
import pytest
import torch
from safetensors.torch import save_file

REL_TOL = 1e-4
LORA = "sdopt-test-lora.safetensors"
CONV_LORA = "sdopt-test-conv-lora.safetensors"


@pytest.fixture(scope="module")
def mini(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    return model, comfy_host.sample(model)


def compiled(comfy_host, model, mode="compile", backend="inductor", on_unavailable="fallback"):
    (patched,) = comfy_host.nodes["SDOptCompile"]().patch(model, mode, backend, "default", False, False, on_unavailable)
    return patched


def fast_path(comfy_host, model):
    return comfy_host.glue.fast_path_of(model)


def close(out, reference):
    return (out - reference).abs().max().item() <= REL_TOL * reference.abs().max().item()


@pytest.mark.parametrize("mode,backend", [("compile", "inductor"), ("compile_regional", "inductor"), ("trace", "inductor")])
def test_compiled_sampling_matches_stock_and_leaves_the_model_alone(comfy_host, mini, mode, backend):
    torch._dynamo.reset()  # dynamo caches per code object: an earlier test's frames would be reused
    model, stock = mini
    patched = compiled(comfy_host, model, mode, backend)
    assert close(comfy_host.sample(patched), stock)
    assert torch.equal(comfy_host.sample(model), stock), "the model the node was given must be unchanged"
    (compile_stats,), _ = fast_path(comfy_host, patched).stats()
    assert compile_stats.compilations >= 1 and compile_stats.cache_entries == 1


def test_new_steps_and_seed_do_not_recompile(comfy_host, mini):
    import nodes

    patched = compiled(comfy_host, mini[0], "compile_regional")
    comfy_host.sample(patched)
    (stats,), _ = fast_path(comfy_host, patched).stats()
    compilations = stats.compilations
    positive, negative = comfy_host._conds
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    nodes.common_ksampler(patched, 7, 3, 4.5, "dpmpp_2m", "karras", positive, negative, latent)
    assert stats.compilations == compilations, stats.recompile_reasons


def write_lora(folder, model, file=LORA, convs=False) -> None:
    """A rank-4 LoRA in ComfyUI's generic key format over every attention projection of the UNet,
    and with ``convs`` over every conv of its first input blocks (LoCon style: down k x k, up 1 x 1)."""
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for name, param in model.model.diffusion_model.named_parameters():
        attention = any(part in name for part in (".to_q.", ".to_k.", ".to_v."))
        conv = convs and param.ndim == 4 and name.startswith(("input_blocks.0.", "input_blocks.1."))
        if (attention or conv) and name.endswith(".weight"):
            key = f"diffusion_model.{name[:-len('.weight')]}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(4, *param.shape[1:], generator=generator) * 0.05
            tensors[f"{key}.lora_up.weight"] = torch.randn(param.shape[0], 4, *[1] * (param.ndim - 2), generator=generator) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / file))


@pytest.fixture(scope="module")
def lora(comfy_host, mini, tmp_path_factory):
    import folder_paths

    folder = tmp_path_factory.mktemp("loras")
    write_lora(folder, mini[0])
    write_lora(folder, mini[0], CONV_LORA, convs=True)
    folder_paths.add_model_folder_path("loras", str(folder))
    return LORA


def with_lora(model, lora_name, strength):
    import nodes

    return nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora_name, strength)[0]


# regional compile through aot_eager: its many small graphs would take inductor a minute here
@pytest.mark.parametrize("mode,backend", [("compile", "inductor"), ("trace", "inductor"), ("compile_regional", "aot_eager")])
def test_a_lora_and_its_strength_changes_are_followed_without_recompiling(comfy_host, mini, lora, mode, backend):
    model, stock = mini
    patched = compiled(comfy_host, model, mode, backend)
    assert close(comfy_host.sample(patched), stock)
    compilations = None
    for strength in (1.0, 0.5):
        eager = comfy_host.sample(with_lora(model, lora, strength))
        assert not close(eager, stock), "the test LoRA must change the output"
        assert close(comfy_host.sample(with_lora(patched, lora, strength)), eager), f"strength {strength}"
        (stats,), _ = fast_path(comfy_host, patched).stats()
        if compilations is not None:
            assert stats.compilations == compilations, f"a strength change recompiled: {stats.recompile_reasons}"
        compilations = stats.compilations
    assert close(comfy_host.sample(patched), stock), "after the LoRA is gone, the compiled model uses the original weights"


def test_a_conv_lora_over_channels_last_weights_keeps_their_layout_and_never_recompiles(comfy_host, mini, lora):
    model, stock = mini
    (channels_last,) = comfy_host.nodes["SDOptPrecision"]().patch(model, "default", "default", False, True)
    patched = compiled(comfy_host, channels_last)
    assert close(comfy_host.sample(patched), stock)
    (stats,), _ = fast_path(comfy_host, patched).stats()
    compilations = stats.compilations
    for strength in (1.0, 0.5):
        eager = comfy_host.sample(with_lora(model, CONV_LORA, strength))
        assert not close(eager, stock), "the test LoRA must change the output"
        lora_model = with_lora(patched, CONV_LORA, strength)
        assert close(comfy_host.sample(lora_model), eager), f"strength {strength}"
        conv = lora_model.model.diffusion_model.input_blocks[1][0].in_layers[2].weight
        assert conv.is_contiguous(memory_format=torch.channels_last), "the patched weight kept the channels-last layout"
        assert stats.compilations == compilations, f"the LoRA recompiled: {stats.recompile_reasons}"


def test_cuda_graph_passes_through_on_a_cpu_and_says_so(comfy_host, mini):
    model, stock = mini
    (patched,) = comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "fallback")
    assert torch.equal(comfy_host.sample(patched), stock)
    (record,) = comfy_host.glue.model_records(patched.model_options)
    assert record["active"] == "eager" and "CUDA graphs need a CUDA device" in record["note"]
    error = comfy_host.pack("errors").UserError
    with pytest.raises(error, match="on_unavailable: CUDA graphs need a CUDA device"):
        comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "error")


def test_compile_then_graph_share_one_fast_path(comfy_host, mini):
    model, _ = mini
    patched = compiled(comfy_host, model, "trace")
    assert comfy_host.wrapper_counts(patched, comfy_host.glue.FAST_PATH_KEY) == {"diffusion_model": 1, "sampler_sample": 1}
    again = compiled(comfy_host, patched, "compile_regional")
    assert fast_path(comfy_host, again).compile_config.mode == "compile_regional"
    assert fast_path(comfy_host, patched).compile_config.mode == "trace", "the upstream clone keeps its own fast path"
    assert comfy_host.wrapper_counts(again, comfy_host.glue.FAST_PATH_KEY) == {"diffusion_model": 1, "sampler_sample": 1}
