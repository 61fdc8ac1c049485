"""SDOptPrecision in real ComfyUI, on each family's mini checkpoint (SD1.5, SDXL, SD3.5; Flux's bf16
against ComfyUI's own).

Two sampling steps at 64x64 with the original model and with patched clones (every dtype, auto and
channels-last on both families): outputs stay finite and close to fp32, and the original model
(shared, like ComfyUI's cache shares it) is bit-identical afterwards. Chained nodes end with the second one's settings, wrappers and record;
``auto`` records what it picked and why.
"""
import re

import pytest
import torch

from sdopt.optim.precision import compute_supported, dtype_name

from ..numerics import rel_err, stored_dtypes

NODE = "SDOptPrecision"
# Relative L2 error of the sampled latent against the fp32 model's. A half-precision case may also
# reach COMFY_BF16_FACTOR x the error of ComfyUI's own bf16 (the checkpoint loaded with bf16 weights,
# computed in bf16): the random-weight Flux mini (3072 wide, CFG 7) loses 0.35 of its latent to bf16
# compute in ComfyUI itself, exactly what sdopt's bf16 loses (0.005 with fp32 compute).
REL_TOL = {"bf16": 0.06, "fp16": 0.01, "fp8_e4m3fn": 0.25, "fp32": 1e-4}
FP8_MATMUL_REL_TOL = REL_TOL["fp8_e4m3fn"]
COMFY_BF16_FACTOR = 1.25


@pytest.fixture(scope="module")
def device(checkpoint):
    return checkpoint[0].load_device


@pytest.fixture(scope="module")
def patching(comfy_host):
    return comfy_host.patching


def precision_records(patching, model) -> list[dict]:
    return [r for r in patching.model_records(model.model_options) if r["node"] == NODE]


def _tf32_flags():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def sample_with_spy(comfy_host, model):
    """(latent, what the diffusion model got and the TF32 flags while it ran) for ``model``: a global
    forward pre-hook that watches only its diffusion model, since ComfyUI runs no wrapper around
    SD3's (the hook is removed afterwards)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    seen, target = {}, model.model.diffusion_model

    def spy(module, args):
        if module is target and args:
            x = args[0]
            seen.update(x_dtype=x.dtype, tf32=_tf32_flags(),
                        x_channels_last=x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())

    handle = register_module_forward_pre_hook(spy)
    try:
        return comfy_host.sample(model), seen
    finally:
        handle.remove()


def _cases(device):
    half = "fp16" if compute_supported(torch.float16, device) else "bf16"
    fp8_compute = "bf16" if compute_supported(torch.bfloat16, device) else "fp32"
    return {
        "bf16 weights, channels_last": ("bf16", dict(weight_dtype="bf16", compute_dtype="default", tf32=False, channels_last=True)),
        f"{half} compute, tf32": (
            half,
            dict(weight_dtype="default", compute_dtype=half, tf32=True, channels_last=False),
        ),
        f"fp8_e4m3fn weights, {fp8_compute} compute, tf32": (
            "fp8_e4m3fn",
            dict(weight_dtype="fp8_e4m3fn", compute_dtype=fp8_compute, tf32=True, channels_last=False),
        ),
        "channels_last alone": ("fp32", dict(weight_dtype="default", compute_dtype="default", tf32=False, channels_last=True)),
    }


def _comfy_bf16(host):
    """The family's mini checkpoint as ComfyUI itself runs it in bf16: loaded with bf16 weights, computed in bf16."""
    import comfy.sd

    model = comfy.sd.load_checkpoint_guess_config(str(host.checkpoint), output_vae=False, output_clip=False,
                                                  model_options={"dtype": torch.bfloat16})[0]
    model.set_model_compute_dtype(torch.bfloat16)
    return model


@pytest.fixture(scope="module", params=["sd15", "sdxl", "sd35"])
def runs(comfy_host, device, patching, request):
    """Sample one family's mini model with the original, every patched clone, then the original again."""
    host = comfy_host.family(request.param)
    model = host.load_checkpoint()[0]
    node = host.nodes[NODE]()
    original = {
        "dtypes": stored_dtypes(model.model.diffusion_model),
        "model_dtype": model.model_dtype(),
        "manual_cast": model.model.manual_cast_dtype,
        "wrappers": {kind: dict(keys) for kind, keys in model.wrappers.items()},
        "options": set(model.model_options),
    }
    reference = host.sample(model)
    comfy_bf16 = rel_err(host.sample(_comfy_bf16(host)), reference)
    flags_before = _tf32_flags()
    results = {}
    for name, (tol_key, inputs) in _cases(device).items():
        patched = node.patch(model, **inputs)[0]
        out, seen = sample_with_spy(host, patched)
        tol = REL_TOL[tol_key] if tol_key == "fp32" else max(REL_TOL[tol_key], COMFY_BF16_FACTOR * comfy_bf16)
        results[name] = dict(inputs=inputs, tol=tol, model=patched, out=out, seen=seen)
    return dict(
        host=host,
        model=model,
        original=original,
        reference=reference,
        again=host.sample(model),
        flags_before=flags_before,
        flags_after=_tf32_flags(),
        results=results,
    )


def test_flux_in_bf16_equals_comfyuis_own_bf16_bitwise_and_leaves_the_model_alone(comfy_host):
    """Flux's mini (3072 wide; every dtype case of ``runs`` is held on SD1.5, SDXL and SD3.5): bf16
    weights computed in bf16 give exactly what ComfyUI's own bf16 gives, which loses 0.35 of the
    latent to bf16 compute on these random weights; bf16 weights computed in fp32 stay close."""
    host = comfy_host.family("flux")
    model = host.load_checkpoint()[0]
    reference = host.sample(model)
    node = host.nodes[NODE]()
    bf16 = node.patch(model, "bf16", "default", False, False)[0]
    assert stored_dtypes(bf16.model.diffusion_model) == {torch.bfloat16}
    assert torch.equal(host.sample(bf16), host.sample(_comfy_bf16(host)))
    upcast = node.patch(model, "bf16", "fp32", False, False)[0]
    assert rel_err(host.sample(upcast), reference) < REL_TOL["fp16"]
    assert torch.equal(host.sample(model), reference), "the model the node was given must be unchanged"


def test_auto_keeps_weights_loaded_in_fp8_and_computes_in_its_pick_also_after_another_precision_node(comfy_host, patching):
    """A model ComfyUI loaded in fp8 (Load Diffusion Model's weight_dtype, or an fp8 checkpoint, which ComfyUI
    keeps in fp8 where fp16 weights would not fit): auto's pick (bf16 or fp32 here) would double or quadruple
    its weights, so it keeps them and only computes in the pick, exactly as ComfyUI's own compute dtype
    setting does; after a bf16 Precision node it goes back to the fp8 weights as loaded."""
    import comfy.sd

    model = comfy.sd.load_checkpoint_guess_config(str(comfy_host.checkpoint), output_vae=False, output_clip=False,
                                                  model_options={"dtype": torch.float8_e4m3fn})[0]
    reference = comfy_host.sample(model)
    node = comfy_host.nodes[NODE]()
    (auto,) = node.patch(model, "auto", "default", False, False)
    (record,) = precision_records(patching, auto)
    pick = record["active"].split("compute=")[1]
    assert auto.model is model.model, "no converted copy"
    assert record["active"] == f"weight=fp8_e4m3fn, compute={pick}" and pick in ("bf16", "fp32")
    assert f"auto: weights kept in fp8_e4m3fn as loaded, since a {pick} copy would take" in record["note"]
    comfys_own = model.clone()
    comfys_own.set_model_compute_dtype(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[pick]))
    assert torch.equal(comfy_host.sample(auto), comfy_host.sample(comfys_own))
    (chained,) = node.patch(node.patch(model, "bf16", "default", False, False)[0], "auto", "default", False, False)
    assert stored_dtypes(chained.model.diffusion_model) == {torch.float8_e4m3fn}
    assert torch.equal(comfy_host.sample(chained), comfy_host.sample(auto))
    assert torch.equal(comfy_host.sample(model), reference), "the model the node was given must be unchanged"


def test_auto_on_cuda_takes_the_half_dtype_the_models_comfyui_config_prefers(comfy_host, patching, monkeypatch):
    """Flux's config lists bf16 first (its activations overflow fp16 on trained weights), SD1.5's fp16;
    the node reads the list from the loaded model. CUDA's dtype support is faked: no GPU here."""
    precision = comfy_host.pack("optim.precision")
    monkeypatch.setattr(precision, "compute_supported", lambda dtype, device: True)
    picks = {}
    for family in ("sd15", "flux"):
        allowed = comfy_host.environment.inference_dtypes(comfy_host.family(family).load_checkpoint()[0])
        picks[family] = precision.pick_dtype("cuda", allowed).dtype
    assert picks == {"sd15": torch.float16, "flux": torch.bfloat16}


def test_original_model_is_bit_identical_after_the_patched_clones_ran(runs, patching):
    model, original = runs["model"], runs["original"]
    assert torch.isfinite(runs["reference"]).all()
    assert torch.equal(runs["reference"], runs["again"])
    assert stored_dtypes(model.model.diffusion_model) == original["dtypes"]
    assert model.model_dtype() == original["model_dtype"]
    assert model.model.manual_cast_dtype == original["manual_cast"]
    assert model.get_model_object("manual_cast_dtype") == original["manual_cast"]
    assert {kind: dict(keys) for kind, keys in model.wrappers.items()} == original["wrappers"]
    assert set(model.model_options) == original["options"]
    assert patching.RECORDS_KEY not in model.model_options, "records go on the clones only"


@pytest.mark.parametrize("case", range(3))
def test_patched_output_is_finite_and_close_to_fp32(runs, case):
    """The three dtype cases; channels_last alone keeps the dtype and has its own test."""
    name = list(runs["results"])[case]
    result = runs["results"][name]
    err = rel_err(result["out"], runs["reference"])
    assert torch.isfinite(result["out"]).all(), name
    assert err < result["tol"], f"{runs['host'].model_family.title}, {name}: relative error {err:.3g}"
    assert err > 0, f"{name}: the output did not change, so the precision did not apply"


def _result(runs, prefix):
    return next(r for name, r in runs["results"].items() if name.startswith(prefix))


def _half(runs):
    return next(r for name, r in runs["results"].items() if name.endswith(" compute, tf32"))


def test_weight_dtype_makes_a_private_copy_in_that_dtype(runs):
    model = runs["model"]
    bf16 = _result(runs, "bf16 weights")
    unet = bf16["model"].model.diffusion_model
    assert bf16["model"].model is not model.model
    assert stored_dtypes(unet) == {torch.bfloat16}
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in unet.parameters() if p.ndim == 4)
    assert not any(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                   for p in model.model.diffusion_model.parameters() if p.ndim == 4)
    assert bf16["seen"]["x_dtype"] == torch.bfloat16

    fp8 = _result(runs, "fp8_e4m3fn")
    assert stored_dtypes(fp8["model"].model.diffusion_model) == {torch.float8_e4m3fn}
    compute = fp8["inputs"]["compute_dtype"]
    assert dtype_name(fp8["seen"]["x_dtype"]) == compute, "fp8 weights are computed in the compute dtype"
    assert fp8["model"].model_size() < model.model_size() / 2


def test_compute_dtype_clone_shares_weights_and_scopes_tf32(runs):
    half = _half(runs)
    assert half["model"].model is runs["model"].model
    assert dtype_name(half["seen"]["x_dtype"]) == half["inputs"]["compute_dtype"]
    assert not half["seen"]["x_channels_last"]
    assert half["seen"]["tf32"] == (True, True), "TF32 is on while the sampler runs"
    assert runs["flags_after"] == runs["flags_before"], "and restored afterwards"
    assert _result(runs, "bf16 weights")["seen"]["tf32"] == runs["flags_before"], "tf32 off leaves the flags alone"


def test_channels_last_alone_copies_the_weights_channels_last_in_their_dtype(runs):
    """With NCHW weights, channels-last activations would convert every conv weight on every call."""
    model, result = runs["model"], _result(runs, "channels_last alone")
    unet = result["model"].model.diffusion_model
    assert result["model"].model is not model.model, "a private copy"
    assert stored_dtypes(unet) == stored_dtypes(model.model.diffusion_model)
    convs = [p for p in unet.parameters() if p.ndim == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert bool(convs) == (runs["host"].model_family.name != "flux"), "Flux has no conv (its patch embedding is linear)"
    assert not any(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                   for p in model.model.diffusion_model.parameters() if p.ndim == 4)
    assert rel_err(result["out"], runs["reference"]) < REL_TOL[dtype_name(model.model_dtype())]


def test_each_patched_clone_has_one_record_saying_what_is_active(runs, patching, device):
    loaded = dtype_name(runs["model"].model_dtype())
    cpu_tf32 = f"tf32 has no effect on {torch.device(device).type}"

    fp8 = _result(runs, "fp8_e4m3fn")
    compute = fp8["inputs"]["compute_dtype"]
    (record,) = patching.model_records(fp8["model"].model_options)
    assert record["node"] == NODE
    assert record["requested"] == f"weight=fp8_e4m3fn, compute={compute}, tf32=on, channels_last=off"
    assert record["active"] == f"weight=fp8_e4m3fn, compute={compute}, tf32"
    assert "in a private copy; the input model is unchanged" in record["note"]
    assert (cpu_tf32 in record["note"]) == (torch.device(device).type != "cuda")

    half = _half(runs)
    (record,) = patching.model_records(half["model"].model_options)
    assert record["requested"] == f"weight=default, compute={half['inputs']['compute_dtype']}, tf32=on, channels_last=off"
    assert record["active"] == f"weight={loaded}, compute={half['inputs']['compute_dtype']}, tf32"
    assert "private copy" not in record["note"]

    (record,) = patching.model_records(_result(runs, "channels_last alone")["model"].model_options)
    assert record["active"] == f"weight={loaded}, compute={loaded}, channels_last"
    assert "conv weights channels-last, in a private copy" in record["note"]
    few_convs = sum(p.ndim == 4 for p in runs["model"].model.diffusion_model.parameters()) < 2
    assert ("almost no convolutions" in record["short"]) == few_convs

    (record,) = patching.model_records(_result(runs, "bf16 weights")["model"].model_options)
    assert record["requested"] == "weight=bf16, compute=default, tf32=off, channels_last=on"
    assert record["active"] == "weight=bf16, compute=bf16, channels_last"
    assert "tf32" not in record["note"] and "conv weights channels-last" in record["note"]


FIRST_SECOND = {
    # weights converted (channels-last weights), then back to fp32 with nothing else
    "bf16+tf32+channels_last, then fp32": (
        dict(weight_dtype="bf16", compute_dtype="default", tf32=True, channels_last=True),
        dict(weight_dtype="fp32", compute_dtype="default", tf32=False, channels_last=False),
        {"outer_sample": 1},
        {},
    ),
    "bf16+tf32+channels_last, then default+tf32": (
        dict(weight_dtype="bf16", compute_dtype="default", tf32=True, channels_last=True),
        dict(weight_dtype="default", compute_dtype="default", tf32=True, channels_last=False),
        {"outer_sample": 1},
        {"outer_sample": 1},
    ),
    # channels_last=off does not convert back: the second keeps the first's weights
    "default+tf32+channels_last, then default+tf32": (
        dict(weight_dtype="default", compute_dtype="default", tf32=True, channels_last=True),
        dict(weight_dtype="default", compute_dtype="default", tf32=True, channels_last=False),
        {"outer_sample": 1},
        {"outer_sample": 1},
    ),
}


@pytest.fixture(scope="module")
def sd15_reference(comfy_host, checkpoint):
    """The SD1.5 mini's stock latent and the TF32 flags outside sampling."""
    return dict(reference=comfy_host.sample(checkpoint[0]), flags_before=_tf32_flags())


@pytest.mark.parametrize("chain", list(FIRST_SECOND))
def test_chained_nodes_end_with_the_second_ones_settings(comfy_host, checkpoint, sd15_reference, patching, chain):
    first_inputs, second_inputs, first_wrappers, second_wrappers = FIRST_SECOND[chain]
    model, node = checkpoint[0], comfy_host.nodes[NODE]()
    (first,) = node.patch(model, **first_inputs)
    (second,) = node.patch(first, **second_inputs)

    assert comfy_host.wrapper_counts(first, NODE) == first_wrappers
    assert comfy_host.wrapper_counts(second, NODE) == second_wrappers, "one set of sdopt wrappers: the second node's"
    (first_record,) = precision_records(patching, first)
    (record,) = precision_records(patching, second)
    tf32, channels_last = ("on" if second_inputs[k] else "off" for k in ("tf32", "channels_last"))
    assert record["requested"] == f"weight={second_inputs['weight_dtype']}, compute=default, tf32={tf32}, channels_last={channels_last}"
    assert first_record["requested"].startswith(f"weight={first_inputs['weight_dtype']},"), "the first clone keeps its own record"

    out, seen = sample_with_spy(comfy_host, second)
    assert torch.isfinite(out).all()
    assert seen["tf32"] == ((True, True) if second_inputs["tf32"] else sd15_reference["flags_before"])
    assert not seen["x_channels_last"], "the second node asked for no channels-last activations"
    if second_inputs["weight_dtype"] == "fp32":
        assert record["active"] == "weight=fp32, compute=fp32"
        assert stored_dtypes(second.model.diffusion_model) == {torch.float32}
        assert stored_dtypes(first.model.diffusion_model) == {torch.bfloat16}, "the first node's copy is left as it is"
        assert seen["x_dtype"] == torch.float32
        assert torch.equal(out, sd15_reference["reference"]), "fp32 from the original weights, not from the bf16 copy"
    else:
        first_dtype = dtype_name(first.model_dtype())
        assert record["active"] == f"weight={first_dtype}, compute={first_dtype}, tf32"
        assert second.model is first.model, "default keeps the first node's weights, shared"
    assert torch.equal(comfy_host.sample(model), sd15_reference["reference"]), "the original model is unchanged"


CHAINS = {
    "bf16, then fp32": (dict(weight_dtype="bf16"), dict(weight_dtype="fp32")),
    "fp32 channels_last, then bf16": (dict(weight_dtype="fp32", channels_last=True), dict(weight_dtype="bf16")),
    "fp8, then bf16 channels_last": (dict(weight_dtype="fp8_e4m3fn"), dict(weight_dtype="bf16", channels_last=True)),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_chain_of_two_weight_copies_equals_the_second_alone_bitwise(comfy_host, checkpoint, chain):
    """The second node converts the weights the model had before the first copy: one rounding, not two."""
    model, node = checkpoint[0], comfy_host.nodes[NODE]()
    inputs = lambda given: dict(dict(compute_dtype="default", tf32=False, channels_last=False), **given)
    first, second = (inputs(given) for given in CHAINS[chain])
    (chained,) = node.patch(node.patch(model, **first)[0], **second)
    (alone,) = node.patch(model, **second)
    assert torch.equal(comfy_host.sample(chained), comfy_host.sample(alone))
    assert all(torch.equal(a, b) for a, b in zip(chained.model.diffusion_model.state_dict().values(), alone.model.diffusion_model.state_dict().values()))


def test_weight_dtype_is_auto_by_default_and_offers_every_dtype(comfy_host):
    options, spec = comfy_host.nodes[NODE].INPUT_TYPES()["required"]["weight_dtype"]
    assert options == ["auto", "default", "fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"]
    assert spec["default"] == "auto"


def test_auto_records_what_it_picked_and_why(comfy_host, device, runs, patching):
    precision = comfy_host.pack("optim.precision")
    model = runs["model"]
    (patched,) = comfy_host.nodes[NODE]().patch(model, "auto", "default", False, False)
    allowed = comfy_host.environment.inference_dtypes(model)
    pick = precision.pick_dtype(device, allowed)  # cached: the pick the node made
    picked = dtype_name(pick.dtype)

    (record,) = patching.model_records(patched.model_options)
    assert record["requested"] == "weight=auto, compute=default, tf32=off, channels_last=off"
    assert record["active"] == f"weight={picked}, compute={picked}"
    assert record["note"].startswith(f"auto: {pick.reason}")
    if torch.device(device).type == "cuda":
        assert pick.dtype == allowed[0], "the half dtype ComfyUI's config for this model lists first"
    else:
        assert pick.dtype in (torch.float32, torch.bfloat16)
        if compute_supported(torch.bfloat16, device):
            ratio = precision._bf16_over_fp32(str(torch.device(device)))
            assert f"took {ratio:.2f}x the fp32 time in bf16" in pick.reason
            assert (pick.dtype == torch.bfloat16) == (ratio < precision.BF16_FASTER_BELOW)
        else:
            assert pick.dtype == torch.float32 and "bf16 does not run" in pick.reason

    assert stored_dtypes(patched.model.diffusion_model) == {pick.dtype}
    assert (patched.model is model.model) == (pick.dtype == model.model_dtype()), "a private copy only for a new dtype"
    out = runs["host"].sample(patched)
    assert torch.isfinite(out).all()
    assert rel_err(out, runs["reference"]) < REL_TOL[picked]
    assert torch.equal(runs["host"].sample(model), runs["reference"])


def test_weight_copy_carries_weight_patches_once(comfy_host, checkpoint):
    """A LoRA-like patch on the input is applied to the private copy, and only once,
    even though the shared model was just sampled with the patch applied to it."""
    model = checkpoint[0]
    state = model.model.state_dict()
    keys = [k for k, v in state.items() if k.startswith("diffusion_model.input_blocks.1.") and v.ndim == 4]
    g = torch.Generator().manual_seed(5)
    lora = model.clone()
    lora.add_patches({k: ("diff", (torch.randn(state[k].shape, generator=g) * state[k].std(),)) for k in keys}, 1.0)
    base_out = comfy_host.sample(model)
    lora_out = comfy_host.sample(lora)
    assert rel_err(lora_out, base_out) > 0.1, "the patch matters"
    patched = comfy_host.nodes[NODE]().patch(lora, "bf16", "default", False, False)[0]
    assert patched.model is not model.model and set(keys) <= set(patched.patches)
    assert rel_err(comfy_host.sample(patched), lora_out) < REL_TOL["bf16"]
    assert torch.equal(comfy_host.sample(lora), lora_out)
    assert torch.equal(comfy_host.sample(model), base_out)


def test_bad_weight_dtype_is_a_user_error_naming_the_input(comfy_host, checkpoint):
    UserError = comfy_host.pack("errors").UserError
    with pytest.raises(UserError, match=r"^weight_dtype: 'fp64' is not offered"):
        comfy_host.nodes[NODE]().patch(checkpoint[0], "fp64", "default", False, False)


def test_fp8_matmul_multiplies_the_linears_in_fp8_near_the_upcast_fp8_model_and_follows_a_lora(comfy_host):
    """SD3.5's mini (its blocks are Linear layers): fp8 e4m3 weights multiplied in fp8 against the
    same weights upcast (on a CPU the other ops compute in fp32); the difference is the activations'
    e4m3 rounding (measured: 0.14 of the latent's norm with bf16 for the rest, on random weights)."""
    host = comfy_host.family("sd35")
    model = host.load_checkpoint()[0]
    stock = host.sample(model)
    node = host.nodes[NODE]()
    upcast = node.patch(model, "fp8_e4m3fn", "fp32", False, False)[0]
    fp8 = node.patch(model, "fp8_e4m3fn", "fp8_matmul", False, False)[0]
    (record,) = host.patching.model_records(fp8.model_options)
    assert record["active"] == "weight=fp8_e4m3fn, compute=fp8_matmul+fp32"
    assert re.search(r"fp8 matmuls: (\d+) of \1 Linear layers through torch._scaled_mm's fp32 emulation \(a CPU has no fp8 unit\)", record["note"]), record["note"]
    out = host.sample(fp8)
    print(f"fp8_matmul vs upcast fp8: {rel_err(out, host.sample(upcast)):.4f}; vs stock fp32: {rel_err(out, stock):.4f}")
    assert torch.isfinite(out).all() and rel_err(out, host.sample(upcast)) < FP8_MATMUL_REL_TOL
    lora = host.with_lora(fp8, host.lora(), 0.5)
    with_lora = host.sample(lora)
    assert not torch.equal(with_lora, out), "the fp8 matmuls read the LoRA-patched weights"
    assert rel_err(with_lora, host.sample(host.with_lora(upcast, host.lora(), 0.5))) < FP8_MATMUL_REL_TOL
    assert torch.equal(host.sample(model), stock), "the model the node was given must be unchanged"
