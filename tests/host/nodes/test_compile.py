"""SDOptCompile and SDOptCUDAGraph in real ComfyUI, on the mini SD1.5 and SDXL checkpoints (CPU, fp32).

Sampling is ComfyUI's own KSampler path (2 euler steps at 64x64, CFG 7). A compiled clone must give
the stock latent within ``REL_TOL`` of its largest magnitude (inductor reorders fp32 reductions;
trace and aot_eager run the eager kernels), must not recompile when steps or seed change, and must
follow a LoRA loaded downstream through the stock LoraLoaderModelOnly at every strength, also over
channels-last conv weights (Precision's channels_last), whose layout the LoRA must keep. A LoRA
loaded before the node (its strength changed upstream, so the node runs again) is used as well.

On SDXL the model goes through sdopt Attention (sdpa) first, as the sdxl_fast workflow wires it;
Compile wired alone, on both families, routes attention through sdpa itself where ComfyUI's CPU
attention would split the compiled graph, and compiles once. SDXL's whole-UNet compile runs through
aot_eager there (dynamo captures the UNet with SDXL's ``y`` input as on inductor, while inductor's code
generation, whose numerics do not depend on the family and are held on SD1.5, took 13 minutes for the
SDXL mini on this 2-core CPU), and its LoRA tests compile as a trace. The SD3.5 mini loaded with fp8
weights, as Flux usually runs, compiles regionally through inductor and follows a LoRA patched into them.
"""
import functools
import warnings

import pytest
import torch

from sdopt.families import FAMILIES

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def mini(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    return model, comfy_host.sample(model)


@pytest.fixture(scope="module")
def xl(comfy_host):
    """(host, model with sdopt Attention sdpa, the model as loaded, stock latent) of the SDXL mini."""
    host = comfy_host.family("sdxl")
    model = host.load_checkpoint()[0]
    (sdpa,) = host.nodes["SDOptAttention"]().patch(model, "sdpa", "fallback", 0, 32)
    return host, sdpa, model, host.sample(model)


@pytest.fixture(scope="module")
def dits(comfy_host):
    """{family: (host, model, model, stock latent)} of the SD3.5 and Flux minis, loaded on first use."""
    loaded = {}

    def get(name):
        if name not in loaded:
            host = comfy_host.family(name)
            model = host.load_checkpoint()[0]
            loaded[name] = (host, model, model, host.sample(model))
        return loaded[name]

    return get


def _family(request, comfy_host, family):
    """(host, model to compile, model as loaded, stock latent) of ``family``."""
    if family == "sdxl":
        return request.getfixturevalue("xl")
    if family in ("sd35", "flux"):
        return request.getfixturevalue("dits")(family)
    model, stock = request.getfixturevalue("mini")
    return comfy_host, model, model, stock


def compiled(comfy_host, model, mode="compile", backend="inductor", on_unavailable="fallback"):
    (patched,) = comfy_host.nodes["SDOptCompile"]().patch(model, mode, backend, "default", False, False, on_unavailable)
    return patched


def fast_path(comfy_host, model):
    return comfy_host.fast_path.fast_path_of(model)


def close(out, reference):
    return (out - reference).abs().max().item() <= REL_TOL * reference.abs().max().item()


# SDXL's whole-UNet compile is held to stock by test_compile_wired_alone...[sdxl-aot_eager]; its regional
# compile (10 compilations, 16 s here) runs below. Regional compile runs through aot_eager: inductor's
# numerics are held by the whole-UNet compile, and its code generation for the regional graphs took two
# minutes of CI. SD3.5's whole-model compile runs through aot_eager as
# well: dynamo's capture of the MMDiT is what is SD3.5's own (inductor's code for it took 50 s of CI).
@pytest.mark.parametrize("family,mode,backend", [
    ("sd15", "compile", "inductor"), ("sd15", "compile_regional", "aot_eager"), ("sd15", "trace", "inductor"),
    ("sdxl", "compile_regional", "aot_eager"), ("sdxl", "trace", "inductor"),
    ("sd35", "compile", "aot_eager"), ("sd35", "compile_regional", "aot_eager"), ("sd35", "trace", "inductor"),
    ("flux", "compile_regional", "aot_eager"), ("flux", "trace", "inductor"),
])
def test_compiled_sampling_matches_stock_and_leaves_the_model_alone(request, comfy_host, family, mode, backend):
    torch._dynamo.reset()  # dynamo caches per code object: an earlier test's frames would be reused
    host, model, loaded, stock = _family(request, comfy_host, family)
    patched = compiled(comfy_host, model, mode, backend)
    assert close(host.sample(patched), stock)
    assert torch.equal(host.sample(loaded), stock), "the model the node was given must be unchanged"
    (compile_stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
    assert compile_stats.compilations >= 1 and compile_stats.cache_entries == 1
    if mode == "compile_regional":  # every block kind the family describes, Flux's one block of each included
        assert set(compile_stats.regional_blocks) == set(FAMILIES[family].repeated_blocks)
        # alike blocks at other places share their compile: a place left in the options would show here
        assert not any("transformer_options" in reason for reason in compile_stats.recompile_reasons), compile_stats.recompile_reasons


def test_new_steps_and_seed_do_not_recompile(comfy_host, mini):
    import nodes

    patched = compiled(comfy_host, mini[0])  # the whole-UNet compile above left its graph in sdopt's cache
    comfy_host.sample(patched)
    (stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
    compilations = stats.compilations
    positive, negative = comfy_host._conds
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    nodes.common_ksampler(patched, 7, 3, 4.5, "dpmpp_2m", "karras", positive, negative, latent)
    assert stats.compilations == compilations, stats.recompile_reasons


@pytest.fixture(scope="module")
def loras(comfy_host):
    """family → its attention LoRA's name, and "conv" → SD1.5's conv LoRA; each written on first use (a
    family this ComfyUI cannot load skips only its own tests)."""

    @functools.cache
    def lora(family: str) -> str:
        return comfy_host.lora(convs=True) if family == "conv" else comfy_host.family(family).lora()
    return lora


# regional compile through aot_eager: its many small graphs would take inductor a minute here; SDXL as a
# trace: dynamo's capture of the SDXL mini took four minutes of CI, and how a LoRA reaches compiled code
# is the same for every mode (weights are inputs, never constants); SD3.5's whole-model compile through
# aot_eager too: its capture is what is SD3.5's own, inductor's numerics are held on SD1.5 (50 s of CI);
# SD1.5's whole-UNet compile through aot_eager: dynamo lifts the weights to inputs before any backend
# sees them, and inductor's code is held by the test above (40 s of CI); regional compile on SD3.5 and Flux,
# whose repeated blocks are where it is meant to run (SD1.5's took 45 s of CI)
@pytest.mark.parametrize("family,mode,backend", [
    ("sd15", "compile", "aot_eager"), ("sd15", "trace", "inductor"),
    ("sdxl", "trace", "inductor"), ("sd35", "compile", "aot_eager"), ("sd35", "compile_regional", "aot_eager"),
    ("flux", "compile_regional", "aot_eager"),
])
def test_a_lora_and_its_strength_changes_are_followed_without_recompiling(request, comfy_host, loras, family, mode, backend):
    torch._dynamo.reset()
    host, model, loaded, stock = _family(request, comfy_host, family)
    lora = loras(family)
    patched = compiled(comfy_host, model, mode, backend)
    assert close(host.sample(patched), stock)
    compilations = None
    eager_at = functools.cache(lambda strength: host.sample(comfy_host.with_lora(model, lora, strength)))
    for strength in (1.0, 0.5, 1.0):
        eager = eager_at(strength)
        assert not close(eager, stock), "the test LoRA must change the output"
        assert close(host.sample(comfy_host.with_lora(patched, lora, strength)), eager), f"strength {strength}"
        (stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
        if compilations is not None:
            assert stats.compilations == compilations, f"a strength change recompiled: {stats.recompile_reasons}"
        compilations = stats.compilations
    assert close(host.sample(patched), stock), "after the LoRA is gone, the compiled model uses the original weights"
    assert torch.equal(host.sample(loaded), stock), "the model the node was given must be unchanged"


@torch.inference_mode()  # as ComfyUI runs a prompt: LoRA patches into fp8 weights refuse autograd
def test_fp8_weights_as_comfyui_loads_them_compile_and_follow_a_lora(comfy_host, loras):
    """SD3.5's mini loaded with fp8 e4m3 weights, as Load Diffusion Model's weight_dtype loads Flux on most cards:
    regional compile through inductor computes what ComfyUI's fp8 model computes (the cast to the compute
    dtype inside the compiled blocks), and follows a LoRA that ComfyUI patches into the fp8 weights."""
    import comfy.sd

    torch._dynamo.reset()
    host = comfy_host.family("sd35")
    fp8 = comfy.sd.load_checkpoint_guess_config(str(host.checkpoint), output_vae=False, output_clip=False,
                                                model_options={"dtype": torch.float8_e4m3fn})[0]
    stock = host.sample(fp8)
    patched = compiled(comfy_host, fp8, "compile_regional")
    assert close(host.sample(patched), stock)
    for strength in (1.0, 0.5):
        eager = host.sample(comfy_host.with_lora(fp8, loras("sd35"), strength))
        assert not close(eager, stock), "the test LoRA must change the output"
        assert close(host.sample(comfy_host.with_lora(patched, loras("sd35"), strength)), eager), f"strength {strength}"
    assert torch.equal(host.sample(fp8), stock), "the model the node was given must be unchanged"


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_a_lora_loaded_before_the_node_is_used_at_each_strength(request, comfy_host, loras, family):
    """Changing an upstream LoRA's strength makes ComfyUI run the Compile node again on the new model
    (two strengths: each is a new model, so a third would show nothing new)."""
    host, model, loaded, stock = _family(request, comfy_host, family)
    for strength in (1.0, 0.5):
        lora_model = comfy_host.with_lora(model, loras(family), strength)
        eager = host.sample(lora_model)
        assert not close(eager, stock), "the test LoRA must change the output"
        patched = compiled(comfy_host, lora_model, "trace")
        assert close(host.sample(patched), eager), f"strength {strength}"
        (stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
        assert stats.compilations == 1
    assert torch.equal(host.sample(loaded), stock), "the model the node was given must be unchanged"


def test_a_conv_lora_over_channels_last_weights_keeps_their_layout_and_never_recompiles(comfy_host, mini, loras):
    model, stock = mini
    (channels_last,) = comfy_host.nodes["SDOptPrecision"]().patch(model, "default", "default", False, True)
    patched = compiled(comfy_host, channels_last, backend="aot_eager")  # dynamo guards the weights' layout for every backend
    assert close(comfy_host.sample(patched), stock)
    (stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
    compilations = stats.compilations
    for strength in (1.0, 0.5):
        eager = comfy_host.sample(comfy_host.with_lora(model, loras("conv"), strength))
        assert not close(eager, stock), "the test LoRA must change the output"
        lora_model = comfy_host.with_lora(patched, loras("conv"), strength)
        assert close(comfy_host.sample(lora_model), eager), f"strength {strength}"
        conv = lora_model.model.diffusion_model.input_blocks[1][0].in_layers[2].weight
        assert conv.is_contiguous(memory_format=torch.channels_last), "the patched weight kept the channels-last layout"
        assert stats.compilations == compilations, f"the LoRA recompiled: {stats.recompile_reasons}"


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd35", "flux"])
def test_cuda_graph_passes_through_on_a_cpu_and_says_so(request, comfy_host, family):
    host, _, model, stock = _family(request, comfy_host, family)
    (patched,) = comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "fallback")
    assert torch.equal(host.sample(patched), stock)
    assert torch.equal(host.sample(model), stock), "the model the node was given must be unchanged"
    (record,) = comfy_host.patching.model_records(patched.model_options)
    assert record["active"] == "eager" and "CUDA graphs need a CUDA device" in record["note"]
    error = comfy_host.pack("errors").UserError
    with pytest.raises(error, match="on_unavailable: CUDA graphs need a CUDA device"):
        comfy_host.nodes["SDOptCUDAGraph"]().patch(model, 4, "error")


def test_compile_then_graph_share_one_fast_path(comfy_host, mini):
    model, _ = mini
    patched = compiled(comfy_host, model, "trace")
    assert comfy_host.wrapper_counts(patched, comfy_host.fast_path.FAST_PATH_KEY) == {"diffusion_model": 1, "sampler_sample": 1}
    again = compiled(comfy_host, patched, "compile_regional")
    assert fast_path(comfy_host, again).config_of("SDOptCompile").mode == "compile_regional"
    assert fast_path(comfy_host, patched).config_of("SDOptCompile").mode == "trace", "the upstream clone keeps its own fast path"
    assert comfy_host.wrapper_counts(again, comfy_host.fast_path.FAST_PATH_KEY) == {"diffusion_model": 1, "sampler_sample": 1}


def test_a_trace_wired_alone_freezes_nothing_computed_from_free_memory(comfy_host, mini, prompt_context):
    """ComfyUI's CPU attention sizes its chunks from the free memory psutil reports on each call; a
    trace through it would keep the sizes of the moment it traced (torch warns so, from ComfyUI's
    attention module). Routed through sdpa, the trace holds no such value, and the record says why
    attention was routed. (torch's own group_norm warns of its shape check in every trace.)"""
    model, stock = mini
    patched = compiled(comfy_host, model, "trace")
    profiled = comfy_host.nodes["SDOptProfiler"]().apply(patched, "trace alone")[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        assert close(comfy_host.sample(profiled), stock)
    attention_file = comfy_host.environment.comfy_attention().__file__
    frozen = [f"line {w.lineno}: {w.message}" for w in caught if issubclass(w.category, torch.jit.TracerWarning) and w.filename == attention_file]
    assert not frozen, frozen
    (run,) = comfy_host.prompt_context.prompt_log(prompt_context).runs
    (record,) = [o for o in run["optimizations"] if o["node"] == "SDOptCompile"]
    assert "would freeze values it computes at call time (chunk sizes from free memory) into the trace" in record["note"], record


# SDXL through aot_eager: dynamo captures the same graph as on inductor, which is what is counted here.
@pytest.mark.parametrize("family,backend", [("sd15", "inductor"), ("sdxl", "aot_eager")])
def test_compile_wired_alone_compiles_once_and_its_record_says_how_attention_ran(request, comfy_host, prompt_context, family, backend):
    """Straight after the checkpoint, without sdopt Attention: where ComfyUI's attention breaks the graph
    (its CPU attention asks psutil for free memory), Compile routes attention through sdpa itself."""
    torch._dynamo.reset()
    host, _, loaded, stock = _family(request, comfy_host, family)
    patched = compiled(comfy_host, loaded, "compile", backend)
    profiled = host.nodes["SDOptProfiler"]().apply(patched, "compile alone")[0]
    assert close(host.sample(profiled), stock)
    (stats,) = fast_path(comfy_host, patched).stats("SDOptCompile")
    assert stats.compilations == 1, stats.summary()
    assert (stats.graph_breaks, stats.gave_up, stats.reused) == ({}, {}, {}), stats.details()
    (run,) = comfy_host.prompt_context.prompt_log(prompt_context).runs
    (record,) = [o for o in run["optimizations"] if o["node"] == "SDOptCompile"]
    host_attention = comfy_host.environment.comfy_attention().optimized_attention
    dtype = loaded.model.manual_cast_dtype or loaded.model_dtype()
    breaks = comfy_host.pack("nodes.compile").host_attention_breaks(host_attention, str(torch.device(loaded.load_device)), dtype)
    routed = f"attention routed through sdopt's sdpa: ComfyUI's {host_attention.__name__} breaks torch.compile's graph ({breaks[0]})" if breaks else ""
    assert (routed in record["note"]) if breaks else "attention routed" not in record["note"]
    if torch.device(loaded.load_device).type == "cpu":
        assert "`open`" in breaks[0], "psutil reads /proc/meminfo with open(), which dynamo cannot trace"
    assert record["short"] == "", "it did what was asked"
    assert "optimized_attention_override" not in loaded.model_options.get("transformer_options", {}), "the input model is unchanged"
