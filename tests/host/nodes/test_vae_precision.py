"""SDOptVAEPrecision in real ComfyUI, on the mini checkpoint's VAE (and the 16-channel VAE of the
SD3.5 and Flux minis for the bf16 copy).

Decodes of a 2x2 latent (fp16 convolutions are very slow on some CPUs): a bf16 copy decodes close to
fp32 and leaves the input VAE as it was; the NaN guard redoes a decode whose fp16 output
overflows, shown on a copy of the mini VAE whose decoder passes fp16's range; and the VAE's
record reaches the report even when ComfyUI serves the VAE node from its cache.
"""
import pytest
import torch

from sdopt.optim.precision import dtype_name

from ..numerics import rel_err, stored_dtypes

NODE = "SDOptVAEPrecision"
# A decode of the mini VAE in bf16, and the guard's redo of an overflowing fp16 decode.
VAE_REL_TOL = 0.03
# Below this, a "bf16" decode really ran the fp32 weights.
BF16_MIN_REL_ERR = 1e-3
# Latent side for VAE decodes (16x16 px): fp16 convolutions are very slow on some CPUs, and this
# size already overflows fp16 where the tests want it to.
VAE_LATENT = 2
# Where decoder.conv_in's largest output lands after scaling: past fp16's 65504.
OVERFLOW_TARGET = 3e5


@pytest.fixture(scope="module")
def device(checkpoint):
    return checkpoint[2].device


@pytest.fixture(scope="module")
def latent():
    return torch.randn(1, 4, VAE_LATENT, VAE_LATENT, generator=torch.Generator().manual_seed(0))


def decode(vae, latent):
    with torch.inference_mode():
        return vae.decode(latent)


def prompt_records(comfy_host, prompt_id) -> dict[str, dict]:
    return {r["node"]: r for r in comfy_host.prompt_context.prompt_log(prompt_id).records}


def test_dtype_is_auto_by_default(comfy_host):
    options, spec = comfy_host.nodes[NODE].INPUT_TYPES()["required"]["dtype"]
    assert options == ["auto", "default", "fp32", "fp16", "bf16"]
    assert spec["default"] == "auto"


@pytest.fixture(params=["sd15", "sd35", "flux"])
def family_vae(comfy_host, request):
    """(VAE, a latent for it) of the SD1.5 mini and of the 16-channel VAE of the SD3.5 and Flux minis."""
    host = comfy_host.family(request.param)
    channels = host.model_family.latent.channels
    return host.load_checkpoint()[2], torch.randn(1, channels, VAE_LATENT, VAE_LATENT, generator=torch.Generator().manual_seed(0))


def test_bf16_copy_decodes_close_and_leaves_the_input_vae(comfy_host, family_vae, prompt_context):
    vae, latent = family_vae
    dtype_before, stored_before = vae.vae_dtype, stored_dtypes(vae.first_stage_model)
    reference = decode(vae, latent)
    patched = comfy_host.nodes[NODE]().apply(vae, "bf16", True)[0]
    assert prompt_records(comfy_host, prompt_context) == {}, "records reach a prompt when the copy decodes"
    out = decode(patched, latent)
    assert patched.vae_dtype == torch.bfloat16 and stored_dtypes(patched.first_stage_model) == {torch.bfloat16}
    assert torch.isfinite(out).all()
    assert BF16_MIN_REL_ERR < rel_err(out, reference) < VAE_REL_TOL
    assert vae.vae_dtype == dtype_before and stored_dtypes(vae.first_stage_model) == stored_before
    assert torch.equal(decode(vae, latent), reference)
    assert not hasattr(vae, "sdopt_records") or vae.sdopt_records == []
    (record,) = prompt_records(comfy_host, prompt_context).values()
    assert record["node"] == NODE
    assert record["requested"] == "dtype=bf16, nan_guard=on"
    assert record["active"] == "bf16 (NaN guard redoes NaN/Inf in fp32)"
    assert "in a copy; the input VAE is unchanged" in record["note"]


def test_bf16_then_fp32_decodes_as_fp32_alone_bitwise(comfy_host, checkpoint, latent, prompt_context):
    """The second copy converts the VAE's weights as loaded, not the bf16 copy's."""
    vae, node = checkpoint[2], comfy_host.nodes[NODE]()
    (chained,) = node.apply(node.apply(vae, "bf16", False)[0], "fp32", False)
    (alone,) = node.apply(vae, "fp32", False)
    assert stored_dtypes(chained.first_stage_model) == {torch.float32}
    assert torch.equal(decode(chained, latent), decode(alone, latent))


def test_auto_records_what_it_picked_and_why(comfy_host, checkpoint, latent, device, prompt_context):
    precision = comfy_host.pack("optim.precision")
    vae = checkpoint[2]
    reference = decode(vae, latent)
    patched = comfy_host.nodes[NODE]().apply(vae, "auto", False)[0]
    pick = precision.pick_dtype(device)  # cached: the pick the node made
    if torch.device(device).type != "cuda":
        assert pick.dtype in (torch.float32, torch.bfloat16)
    assert patched.vae_dtype == pick.dtype and stored_dtypes(patched.first_stage_model) == {pick.dtype}
    out = decode(patched, latent)
    assert torch.isfinite(out).all() and rel_err(out, reference) < VAE_REL_TOL
    record = prompt_records(comfy_host, prompt_context)[NODE]
    assert record["requested"] == "dtype=auto, nan_guard=off"
    assert record["active"] == dtype_name(pick.dtype)
    assert record["note"].startswith(f"auto: {pick.reason}")


def test_after_vae_attention_decodes_with_its_own_weights(comfy_host, checkpoint, latent, prompt_context):
    """Chained VAE nodes: the bf16 copy of an attention-patched VAE must decode with the bf16
    weights, not through the attention wrapper's original (fp32) VAE."""
    vae = checkpoint[2]
    reference = decode(vae, latent)
    (with_attention,) = comfy_host.nodes["SDOptVAEAttention"]().patch(vae, "sub_quadratic", "fallback", 0, 32)
    (chained,) = comfy_host.nodes[NODE]().apply(with_attention, "bf16", False)
    out = decode(chained, latent)
    # bf16 weights: about 8.5e-3 from fp32; fp32 weights with another attention backend: about 1e-6.
    assert BF16_MIN_REL_ERR < rel_err(out, reference) < VAE_REL_TOL, "the fp32 weights ran, not the bf16 copy"
    assert torch.equal(decode(vae, latent), reference)
    records = prompt_records(comfy_host, prompt_context)
    assert records[NODE]["active"] == "bf16"
    assert records["SDOptVAEAttention"]["active"].startswith("sub_quadratic"), "both chained nodes are on the record"


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


def test_nan_guard_redoes_an_overflowing_fp16_decode(comfy_host, overflowing_vae, latent, device):
    from comfy_execution.utils import CurrentNodeContext

    node = comfy_host.nodes[NODE]()
    reference = decode(overflowing_vae, latent)
    assert torch.isfinite(reference).all()

    with CurrentNodeContext("test-vae-unguarded", "1"):
        unguarded = decode(node.apply(overflowing_vae, "fp16", False)[0], latent)
    assert not torch.isfinite(unguarded).all(), "without the guard the fp16 decode has NaN"
    assert prompt_records(comfy_host, "test-vae-unguarded")[NODE]["active"] == "fp16"

    guarded = node.apply(overflowing_vae, "fp16", True)[0]
    safer = dtype_name(comfy_host.pack("optim.precision").safe_dtype(torch.float16, device))
    with CurrentNodeContext("test-vae-guarded", "1"):
        out = decode(guarded, latent)
        again = decode(guarded, latent)
        guarded.encode(out[:, :64, :64])  # finite: the encoder is not scaled; the prompt's redo count must stay
    assert torch.isfinite(out).all()
    assert rel_err(out, reference) < VAE_REL_TOL
    assert torch.equal(out, again)
    record = prompt_records(comfy_host, "test-vae-guarded")[NODE]
    assert record["requested"] == "dtype=fp16, nan_guard=on"
    assert record["active"] == f"fp16 (NaN guard redid 2 decodes in {safer})"
    assert record["note"] == f"last decode: NaN/Inf in fp16; redone in {safer}"
    assert overflowing_vae.vae_dtype == torch.float32
    assert stored_dtypes(overflowing_vae.first_stage_model) == {torch.float32}


def test_record_survives_a_cached_vae_node(comfy_host):
    """A second queue with only the seed changed serves the VAE nodes from ComfyUI's cache; the
    decode still files their records, so the report still lists them."""
    overrides = [*comfy_host.SMALL, *comfy_host.FP32_PRECISION_ATTENTION, "SDOptAttention.backend=sdpa",
                 "SDOptVAEAttention.backend=sub_quadratic", "KSampler.steps=1"]
    prompt = comfy_host.prompt(comfy_host.WORKFLOWS / "sd15_precision_attention.json", overrides)
    sampler, vae_node = comfy_host.node_id(prompt, "KSampler"), comfy_host.node_id(prompt, NODE)
    comfy_host.host.clear_cache()
    first = comfy_host.host.execute(prompt)
    prompt[sampler]["inputs"]["seed"] += 1
    second = comfy_host.host.execute(prompt)

    executed = {node["id"] for node in second.report.nodes}
    assert vae_node not in executed and "VAEDecode" in {node["class_type"] for node in second.report.nodes}, (
        "the VAE node was served from the cache, the decode ran"
    )
    assert not second.report.cached and len(second.report.runs) == 1, "the sampler ran again"
    for outcome in (first, second):
        records = {o["node"]: o for o in outcome.report.optimizations}
        assert records[NODE]["requested"] == "dtype=default, nan_guard=on"
        assert records["SDOptVAEAttention"]["active"].startswith("sub_quadratic")


# --- SDXL: the generated SDXL VAE overflows fp16 as the real one does (decoder.mid.block_1.conv1) ---

@pytest.fixture(scope="module")
def sdxl_vae(comfy_host):
    return comfy_host.family("sdxl").load_checkpoint()[2]


def test_nan_guard_catches_the_sdxl_vaes_fp16_overflow(comfy_host, sdxl_vae, device):
    """No weights changed by the test: the SDXL checkpoint's own VAE gives NaN in fp16; the guard
    redoes the decode in a safer dtype, counts it, and the input VAE stays in its dtype."""
    from comfy_execution.utils import CurrentNodeContext

    latent = torch.randn(1, 4, VAE_LATENT, VAE_LATENT, generator=torch.Generator().manual_seed(0))
    dtype_before, stored_before = sdxl_vae.vae_dtype, stored_dtypes(sdxl_vae.first_stage_model)
    reference = decode(sdxl_vae, latent)
    assert torch.isfinite(reference).all()
    node = comfy_host.nodes[NODE]()

    with CurrentNodeContext("test-sdxl-unguarded", "1"):
        unguarded = decode(node.apply(sdxl_vae, "fp16", False)[0], latent)
    assert not torch.isfinite(unguarded).all(), "the SDXL VAE's fp16 decode overflows"

    safer = dtype_name(comfy_host.pack("optim.precision").safe_dtype(torch.float16, device))
    with CurrentNodeContext("test-sdxl-guarded", "1"):
        out = decode(node.apply(sdxl_vae, "fp16", True)[0], latent)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference) < VAE_REL_TOL
    record = prompt_records(comfy_host, "test-sdxl-guarded")[NODE]
    assert record["active"] == f"fp16 (NaN guard redid 1 decode in {safer})"
    assert record["note"] == f"last decode: NaN/Inf in fp16; redone in {safer}"
    assert sdxl_vae.vae_dtype == dtype_before and stored_dtypes(sdxl_vae.first_stage_model) == stored_before
    assert torch.equal(decode(sdxl_vae, latent), reference), "the input VAE decodes exactly as before"
