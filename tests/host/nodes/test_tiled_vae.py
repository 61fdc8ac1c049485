"""SDOptTiledVAE in real ComfyUI, with the stock VAEDecode and VAEEncode, on the mini checkpoint's
VAE (the full SD1.5 VAE architecture, random weights, fp32 on CPU).

A 16x24 latent (128x192 px) in 64 px tiles is a 2x3 grid: the tiled image must match the untiled
one, the input VAE must decode exactly as before, and the node must compose with sdopt VAE
Precision and VAE Attention in either order.
"""
import math

import pytest
import torch

NODE = "SDOptTiledVAE"
TILE = 64
# Tiled against untiled on [0, 1] images: values kept between passes are stored in fp16
# (measured about 70 dB on this VAE; fp32 storage is exact to float rounding, see the unit tier).
MIN_PSNR_DB = 50
# Encoded latents (magnitude ~1-10 with random weights): the same fp16 storage.
LATENT_REL_TOL = 1e-2


def psnr(image, reference) -> float:
    mse = (image.double() - reference.double()).square().mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


@pytest.fixture(scope="module")
def vae(comfy_host):
    return comfy_host.load_checkpoint()[2]


@pytest.fixture(scope="module")
def latent():
    return {"samples": torch.randn(1, 4, 16, 24, generator=torch.Generator().manual_seed(0))}


@pytest.fixture(scope="module")
def pixels():
    return torch.rand(1, 128, 192, 3, generator=torch.Generator().manual_seed(1))


def decode(vae, latent):
    import nodes

    with torch.inference_mode():
        return nodes.VAEDecode().decode(vae, latent)[0]


def encode(vae, pixels):
    import nodes

    with torch.inference_mode():
        return nodes.VAEEncode().encode(vae, pixels)[0]["samples"]


@pytest.fixture(scope="module")
def reference(vae, latent):
    return decode(vae, latent)


def tiled(comfy_host, vae, tile=TILE, overlap=0, only_when_needed=False, budget_mb=0):
    return comfy_host.nodes[NODE]().apply(vae, tile, overlap, only_when_needed, budget_mb)[0]


def records(comfy_host, prompt_id) -> dict[str, dict]:
    return {r["node"]: r for r in comfy_host.prompt_context.prompt_log(prompt_id).records}


def test_inputs_and_their_defaults(comfy_host):
    inputs = comfy_host.nodes[NODE].INPUT_TYPES()["required"]
    assert list(inputs) == ["vae", "tile", "overlap", "only_when_needed", "budget_mb"]
    assert [inputs[name][1]["default"] for name in ("tile", "overlap", "only_when_needed", "budget_mb")] == [0, 0, True, 0]
    assert "0 = auto" in inputs["tile"][1]["tooltip"]


def validation_errors(comfy_host, tile, overlap, budget_mb) -> list[tuple[str, str]]:
    """(input name, message and details) of every error ComfyUI's own validate_prompt files for the node."""
    import asyncio

    import execution

    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": comfy_host.checkpoint.name}},
        "2": {"class_type": NODE, "inputs": {"vae": ["1", 2], "tile": tile, "overlap": overlap,
                                             "only_when_needed": False, "budget_mb": budget_mb}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 0]}},
        "5": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }
    _, _, _, node_errors = asyncio.run(execution.validate_prompt("test-validation", prompt, None))
    assert set(node_errors) <= {"2"}, node_errors
    return [(e["extra_info"]["input_name"], f"{e['message']}: {e['details']}") for e in node_errors.get("2", {}).get("errors", [])]


@pytest.mark.parametrize(("tile", "overlap", "budget_mb", "name", "message"), [
    (100, 0, 0, "tile", "tile: 100 px is not a multiple of 8"),
    (32, 0, 0, "tile", "tile: 32 px is under the 64 px minimum"),
    (256, 0, -1, "budget_mb", "Value -1 smaller than min of 0"),
])
def test_validation_files_each_error_once_under_its_input(comfy_host, vae, tile, overlap, budget_mb, name, message):
    ((input_name, details),) = validation_errors(comfy_host, tile, overlap, budget_mb)
    assert input_name == name and message in details and "\n" not in details


@pytest.mark.parametrize(("tile", "overlap", "budget_mb", "message"), [
    (100, 0, 0, "tile: 100 px is not a multiple of 8"),
    (256, 256, 0, "overlap: 256 px must be smaller than tile"),
    (256, 12, 0, "overlap: 12 px must be 0 or a positive multiple of 8"),
    (256, 0, -1, "budget_mb: -1 is below its minimum"),
])
def test_the_node_names_the_bad_input_when_it_runs(comfy_host, vae, tile, overlap, budget_mb, message):
    """Overlap (it needs tile) passes validation and fails here; linked values skip validation."""
    with pytest.raises(comfy_host.pack("errors").UserError, match=f"^{message}"):
        comfy_host.nodes[NODE]().apply(vae, tile, overlap, False, budget_mb)


def test_valid_inputs_pass_validation(comfy_host):
    assert validation_errors(comfy_host, 0, 64, 0) == []
    assert validation_errors(comfy_host, 512, 64, 2048) == []


def test_stock_decode_tiles_like_untiled_and_leaves_the_input_vae(comfy_host, vae, latent, reference, prompt_context):
    weights_before = {k: v.clone() for k, v in vae.first_stage_model.state_dict().items()}
    patched = tiled(comfy_host, vae)
    out = decode(patched, latent)
    assert out.shape == reference.shape == (1, 128, 192, 3)
    assert psnr(out, reference) >= MIN_PSNR_DB
    assert not torch.equal(out, reference), "fp16 storage rounds: equal images would mean it did not tile"
    record = records(comfy_host, prompt_context)[NODE]
    assert record["requested"] == "tile=64, overlap=0, only_when_needed=off, budget=free memory"
    assert record["active"].startswith(f"decode: tiled {TILE} px, 2x3 = 6 tiles, ")
    assert record["active"].endswith("0 OOM retries")
    assert torch.equal(decode(vae, latent), reference), "the input VAE must decode exactly as before"
    assert all(torch.equal(weights_before[k], v) for k, v in vae.first_stage_model.state_dict().items())
    assert getattr(vae, "sdopt_records", []) == []


def test_overlap_cross_fades_without_changing_the_image(comfy_host, vae, latent, reference):
    out = decode(tiled(comfy_host, vae, overlap=32), latent)
    assert psnr(out, reference) >= MIN_PSNR_DB


def test_stock_encode_tiles_like_untiled(comfy_host, vae, pixels, prompt_context):
    reference = encode(vae, pixels)
    out = encode(tiled(comfy_host, vae), pixels)
    assert out.shape == reference.shape == (1, 4, 16, 24)
    assert ((out - reference).norm() / reference.norm()).item() <= LATENT_REL_TOL
    assert "encode: tiled 64 px, 2x3 = 6 tiles" in records(comfy_host, prompt_context)[NODE]["active"]


def test_only_when_needed_decodes_untiled_when_it_fits(comfy_host, vae, latent, reference, prompt_context):
    out = decode(tiled(comfy_host, vae, tile=0, only_when_needed=True), latent)
    assert torch.equal(out, reference)
    assert records(comfy_host, prompt_context)[NODE]["active"].startswith("decode: untiled (fits: ")
    small = decode(tiled(comfy_host, vae, tile=0, only_when_needed=True, budget_mb=64), latent)
    assert psnr(small, reference) >= MIN_PSNR_DB
    assert records(comfy_host, prompt_context)[NODE]["active"].startswith("decode: tiled ")


@pytest.mark.parametrize("order", ["tiled first", "tiled last"])
def test_composes_with_vae_precision_and_attention(comfy_host, vae, latent, reference, prompt_context, order):
    def precision(v):
        return comfy_host.nodes["SDOptVAEPrecision"]().apply(v, "default", True)[0]

    def attention(v):
        return comfy_host.nodes["SDOptVAEAttention"]().patch(v, "sub_quadratic", "fallback", 0, 32)[0]

    chain = [lambda v: tiled(comfy_host, v), precision, attention]
    if order == "tiled last":
        chain.reverse()
    patched = vae
    for node in chain:
        patched = node(patched)
    assert psnr(decode(patched, latent), reference) >= MIN_PSNR_DB
    found = records(comfy_host, prompt_context)
    assert found[NODE]["active"].startswith(f"decode: tiled {TILE} px, 2x3 = 6 tiles")
    assert found["SDOptVAEAttention"]["active"].startswith("sub_quadratic")
    assert found["SDOptVAEPrecision"]["requested"] == "dtype=default, nan_guard=on"
    assert torch.equal(decode(vae, latent), reference)


# --- SDXL: its VAE's activations pass fp16's range, so the fp16 store keeps those tiles in fp32 ---


@pytest.fixture(scope="module")
def sdxl_vae(comfy_host):
    return comfy_host.family("sdxl").load_checkpoint()[2]


def test_sdxl_decode_and_encode_tile_like_untiled(comfy_host, sdxl_vae, latent, pixels, prompt_context):
    """Kept intermediates hold the mid block's conv1 output, which passes fp16's range on SDXL's VAE:
    those tile values are kept in fp32, the image still matches, and the record counts them."""
    reference, encoded = decode(sdxl_vae, latent), encode(sdxl_vae, pixels)
    assert torch.isfinite(reference).all()
    patched = tiled(comfy_host, sdxl_vae)
    out = decode(patched, latent)
    assert out.shape == reference.shape and psnr(out, reference) >= MIN_PSNR_DB
    active = records(comfy_host, prompt_context)[NODE]["active"]
    assert active.startswith(f"decode: tiled {TILE} px, 2x3 = 6 tiles, ")
    # At 128x192 px keeping the intermediates fits any free RAM, so auto keeps them.
    assert "kept intermediates" in active and "stored tile values past fp16's range kept in fp32" in active, active
    latents = encode(patched, pixels)
    assert ((latents - encoded).norm() / encoded.norm()).item() <= LATENT_REL_TOL
    assert "encode: tiled 64 px, 2x3 = 6 tiles" in records(comfy_host, prompt_context)[NODE]["active"]
    assert torch.equal(decode(sdxl_vae, latent), reference), "the input VAE decodes exactly as before"


# --- SD3.5 and Flux: the 16-channel VAE without quant convs (Flux's under ``vae.``) ---


@pytest.mark.parametrize("family", ["sd35", "flux"])
def test_16_channel_vae_decodes_and_encodes_tiled_like_untiled(comfy_host, family, pixels, prompt_context):
    vae = comfy_host.family(family).load_checkpoint()[2]
    latent = {"samples": torch.randn(1, 16, 16, 24, generator=torch.Generator().manual_seed(0))}
    reference, encoded = decode(vae, latent), encode(vae, pixels)
    assert encoded.shape[1] == 16
    patched = tiled(comfy_host, vae)
    out = decode(patched, latent)
    assert out.shape == reference.shape and psnr(out, reference) >= MIN_PSNR_DB
    assert records(comfy_host, prompt_context)[NODE]["active"].startswith(f"decode: tiled {TILE} px, 2x3 = 6 tiles, ")
    latents = encode(patched, pixels)
    assert ((latents - encoded).norm() / encoded.norm()).item() <= LATENT_REL_TOL
    assert torch.equal(decode(vae, latent), reference), "the input VAE decodes exactly as before"
