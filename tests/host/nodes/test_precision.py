"""SDOptPrecision and SDOptVAEPrecision in real ComfyUI, on the mini checkpoint.

Two sampling steps at 64x64 with the original model and with patched clones: outputs
stay finite and close to fp32, and the original model (shared, like ComfyUI's cache
shares it) is bit-identical afterwards. The VAE node's NaN guard is shown on a copy of
the mini VAE whose decoder overflows fp16.
"""
import uuid

import pytest
import torch

from sdopt.optim.precision import compute_supported, dtype_name

# Relative L2 error of the sampled latent against the fp32 model's.
REL_TOL = {"bf16": 0.06, "fp16": 0.01, "fp8_e4m3fn": 0.25, "fp32": 1e-4}
# A decode of the mini VAE in bf16, and the guard's redo of an overflowing fp16 decode.
VAE_REL_TOL = 0.03
# Below this, a "bf16" decode really ran the fp32 weights.
BF16_MIN_REL_ERR = 1e-3
# Latent side for VAE decodes: fp16 convolutions are very slow on some CPUs.
VAE_LATENT = 4
# Where decoder.conv_in's largest output lands after scaling: past fp16's 65504.
OVERFLOW_TARGET = 3e5


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def stored_dtypes(module):
    return {p.dtype for p in module.parameters()}


@pytest.fixture(scope="module")
def checkpoint(comfy_host):
    return comfy_host.load_checkpoint()


@pytest.fixture(scope="module")
def device(checkpoint):
    return checkpoint[0].load_device


@pytest.fixture(scope="module")
def records(comfy_host):
    return comfy_host.pack("nodes.records")


def _tf32_flags():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _spy(seen: dict):
    """DIFFUSION_MODEL wrapper: what the UNet got, and the TF32 flags while it ran."""

    def spy(executor, x, *args, **kwargs):
        seen.update(
            x_dtype=x.dtype,
            x_channels_last=x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
            tf32=_tf32_flags(),
        )
        return executor(x, *args, **kwargs)

    return spy


def _cases(device):
    half = "fp16" if compute_supported(torch.float16, device) else "bf16"
    fp8_compute = "bf16" if compute_supported(torch.bfloat16, device) else "fp32"
    return {
        "bf16 weights, channels_last": ("bf16", dict(weight_dtype="bf16", compute_dtype="default", tf32=False, channels_last=True)),
        f"{half} compute, tf32, channels_last": (
            half,
            dict(weight_dtype="default", compute_dtype=half, tf32=True, channels_last=True),
        ),
        f"fp8_e4m3fn weights, {fp8_compute} compute, tf32": (
            "fp8_e4m3fn",
            dict(weight_dtype="fp8_e4m3fn", compute_dtype=fp8_compute, tf32=True, channels_last=False),
        ),
    }


@pytest.fixture(scope="module")
def runs(comfy_host, checkpoint, device):
    """Sample with the original, every patched clone, then the original again."""
    import comfy.patcher_extension

    model = checkpoint[0]
    node = comfy_host.nodes["SDOptPrecision"]()
    original = {
        "dtypes": stored_dtypes(model.model.diffusion_model),
        "model_dtype": model.model_dtype(),
        "manual_cast": model.model.manual_cast_dtype,
    }
    reference = comfy_host.sample(model)
    flags_before = _tf32_flags()
    results = {}
    for name, (tol_key, inputs) in _cases(device).items():
        patched = node.patch(model, **inputs)[0]
        seen = {}
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test.spy", _spy(seen))
        results[name] = dict(inputs=inputs, tol=REL_TOL[tol_key], model=patched, out=comfy_host.sample(patched), seen=seen)
    return dict(
        model=model,
        original=original,
        reference=reference,
        again=comfy_host.sample(model),
        flags_before=flags_before,
        flags_after=_tf32_flags(),
        results=results,
    )


def test_original_model_is_bit_identical_after_the_patched_clones_ran(runs):
    model, original = runs["model"], runs["original"]
    assert torch.isfinite(runs["reference"]).all()
    assert torch.equal(runs["reference"], runs["again"])
    assert stored_dtypes(model.model.diffusion_model) == original["dtypes"]
    assert model.model_dtype() == original["model_dtype"]
    assert model.model.manual_cast_dtype == original["manual_cast"]
    assert model.get_model_object("manual_cast_dtype") == original["manual_cast"]


@pytest.mark.parametrize("case", range(3))
def test_patched_output_is_finite_and_close_to_fp32(runs, case):
    name = list(runs["results"])[case]
    result = runs["results"][name]
    err = rel_err(result["out"], runs["reference"])
    assert torch.isfinite(result["out"]).all(), name
    assert err < result["tol"], f"{name}: relative error {err:.3g}"
    assert err > 0, f"{name}: the output did not change, so the precision did not apply"


def _result(runs, prefix):
    return next(r for name, r in runs["results"].items() if name.startswith(prefix))


def test_weight_dtype_makes_a_private_copy_in_that_dtype(runs):
    model = runs["model"]
    bf16 = _result(runs, "bf16 weights")
    unet = bf16["model"].model.diffusion_model
    assert bf16["model"].model is not model.model
    assert stored_dtypes(unet) == {torch.bfloat16}
    assert unet.input_blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.model.diffusion_model.input_blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert bf16["seen"]["x_dtype"] == torch.bfloat16

    fp8 = _result(runs, "fp8_e4m3fn")
    assert stored_dtypes(fp8["model"].model.diffusion_model) == {torch.float8_e4m3fn}
    compute = fp8["inputs"]["compute_dtype"]
    assert dtype_name(fp8["seen"]["x_dtype"]) == compute, "fp8 weights are computed in the compute dtype"
    assert fp8["model"].model_size() < model.model_size() / 2


def test_compute_dtype_clone_shares_weights_and_scopes_tf32(runs):
    half = next(r for name, r in runs["results"].items() if "compute, tf32, channels_last" in name)
    assert half["model"].model is runs["model"].model
    assert dtype_name(half["seen"]["x_dtype"]) == half["inputs"]["compute_dtype"]
    assert half["seen"]["x_channels_last"], "channels_last without a copy makes the activations channels-last"
    assert half["seen"]["tf32"] == (True, True), "TF32 is on while the sampler runs"
    assert runs["flags_after"] == runs["flags_before"], "and restored afterwards"
    assert _result(runs, "bf16 weights")["seen"]["tf32"] == runs["flags_before"], "tf32 off leaves the flags alone"


def test_records_say_what_is_active(runs, records):
    fp8 = _result(runs, "fp8_e4m3fn")
    compute = fp8["inputs"]["compute_dtype"]
    by_request = {r["requested"]: r for r in records.optimization_records(fp8["model"].model_options)}
    assert by_request["weight=fp8_e4m3fn"]["active"] == f"weight=fp8_e4m3fn (compute {compute})"
    assert by_request["weight=fp8_e4m3fn"]["note"].startswith("saves ")
    assert "tf32" in by_request and f"compute={compute}" in by_request
    assert records.optimization_records(runs["model"].model_options) == []


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
    patched = comfy_host.nodes["SDOptPrecision"]().patch(lora, "bf16", "default", False, False)[0]
    assert patched.model is not model.model and set(keys) <= set(patched.patches)
    assert rel_err(comfy_host.sample(patched), lora_out) < REL_TOL["bf16"]
    assert torch.equal(comfy_host.sample(lora), lora_out)
    assert torch.equal(comfy_host.sample(model), base_out)


def test_bad_weight_dtype_is_a_user_error_naming_the_input(comfy_host, checkpoint):
    with pytest.raises(Exception, match=r"^weight_dtype: 'fp64' is not offered") as error:
        comfy_host.nodes["SDOptPrecision"]().patch(checkpoint[0], "fp64", "default", False, False)
    assert type(error.value).__name__ == "UserError"


# -- VAE --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def latent():
    return torch.randn(1, 4, VAE_LATENT, VAE_LATENT, generator=torch.Generator().manual_seed(0))


def decode(vae, latent):
    with torch.inference_mode():
        return vae.decode(latent)


@pytest.fixture
def prompt_context():
    from comfy_execution.utils import CurrentNodeContext

    prompt_id = f"test-precision-{uuid.uuid4().hex}"
    with CurrentNodeContext(prompt_id, "1"):
        yield prompt_id


def test_vae_precision_decodes_finite_and_leaves_the_input_vae(comfy_host, checkpoint, latent, device, prompt_context, records):
    if not compute_supported(torch.bfloat16, device):
        pytest.skip(f"{device} does not compute in bf16")
    vae = checkpoint[2]
    dtype_before, stored_before = vae.vae_dtype, stored_dtypes(vae.first_stage_model)
    reference = decode(vae, latent)
    patched = comfy_host.nodes["SDOptVAEPrecision"]().apply(vae, "bf16", True)[0]
    out = decode(patched, latent)
    assert patched.vae_dtype == torch.bfloat16 and stored_dtypes(patched.first_stage_model) == {torch.bfloat16}
    assert torch.isfinite(out).all()
    assert 0 < rel_err(out, reference) < VAE_REL_TOL
    assert vae.vae_dtype == dtype_before and stored_dtypes(vae.first_stage_model) == stored_before
    assert torch.equal(decode(vae, latent), reference)
    (note,) = records.prompt_notes(prompt_context)
    assert note["requested"] == "dtype=bf16, nan_guard=on"
    assert note["active"] == "bf16 (NaN guard redoes NaN/Inf in fp32)"


def test_vae_precision_after_vae_attention_decodes_with_its_own_weights(comfy_host, checkpoint, latent, device, prompt_context):
    """Chained VAE nodes: the bf16 copy of an attention-patched VAE must decode with the bf16
    weights, not through the attention wrapper's original (fp32) VAE."""
    if not compute_supported(torch.bfloat16, device):
        pytest.skip(f"{device} does not compute in bf16")
    vae = checkpoint[2]
    reference = decode(vae, latent)
    (with_attention,) = comfy_host.nodes["SDOptVAEAttention"]().patch(vae, "sub_quadratic", "fallback", 0, 32)
    (chained,) = comfy_host.nodes["SDOptVAEPrecision"]().apply(with_attention, "bf16", False)
    out = decode(chained, latent)
    # bf16 weights: about 8.5e-3 from fp32; fp32 weights with another attention backend: about 1e-6.
    assert BF16_MIN_REL_ERR < rel_err(out, reference) < VAE_REL_TOL, "the fp32 weights ran, not the bf16 copy"
    assert torch.equal(decode(vae, latent), reference)


@pytest.fixture(scope="module")
def overflowing_vae(checkpoint, latent):
    """A copy of the mini VAE whose decoder.conv_in outputs pass fp16's range (GroupNorm then rescales them)."""
    import comfy.sd

    vae = checkpoint[2]
    with torch.inference_mode():
        model = vae.first_stage_model
        peak = model.decoder.conv_in(model.post_quant_conv(latent.to(vae.vae_dtype))).abs().max().item()
        scale = OVERFLOW_TARGET / peak
        sd = {k: v * scale if k.startswith("decoder.conv_in.") else v for k, v in vae.get_sd().items()}
    return comfy.sd.VAE(sd=sd, dtype=torch.float32)


def test_vae_nan_guard_redoes_an_overflowing_fp16_decode(comfy_host, overflowing_vae, latent, device, prompt_context, records):
    if not compute_supported(torch.float16, device):
        pytest.skip(f"{device} does not compute in fp16")
    node = comfy_host.nodes["SDOptVAEPrecision"]()
    reference = decode(overflowing_vae, latent)
    assert torch.isfinite(reference).all()

    unguarded = decode(node.apply(overflowing_vae, "fp16", False)[0], latent)
    assert not torch.isfinite(unguarded).all(), "without the guard the fp16 decode has NaN"

    guarded = node.apply(overflowing_vae, "fp16", True)[0]
    out = decode(guarded, latent)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference) < VAE_REL_TOL
    safer = "bf16" if compute_supported(torch.bfloat16, device) else "fp32"
    assert [dtype_name(d) for d in guarded.sdopt_safe_vaes] == [safer]
    notes = {n["requested"]: n for n in records.prompt_notes(prompt_context)}
    assert notes["dtype=fp16, nan_guard=on"]["active"] == f"fp16 (NaN guard redid 1 decode in {safer})"
    assert notes["dtype=fp16, nan_guard=off"]["active"] == "fp16"
    assert overflowing_vae.vae_dtype == torch.float32
    assert stored_dtypes(overflowing_vae.first_stage_model) == {torch.float32}
