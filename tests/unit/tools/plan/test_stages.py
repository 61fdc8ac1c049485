"""The planner's stages: SDXL's text encode runs both encoders and its UNet step takes the ``y`` vector
(diffusers' added_cond_kwargs); SD3.5's and Flux's text encoders, their transformer step's inputs as
diffusers takes them, and Flux's latent packing."""
import pytest
import torch

from sdopt.tools.plan import SETTINGS, TEXT_ENCODE, UNET_STEP, Planner, lowmem_setting, stage_call
from sdopt.measure.memory_model import module_bytes

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sdxl_tiny():
    return Planner("sdxl-tiny")


def test_sdxl_text_encode_runs_both_encoders(sdxl_tiny):
    from sdopt.families import checkpoint_config

    clip_l, clip_g = checkpoint_config("sdxl-tiny").text_encoders
    encoders = {name: type(module).__name__ for name, module in sdxl_tiny.modules.items() if name.startswith("text_encoder")}
    assert encoders == {"text_encoder": "CLIPTextModel", "text_encoder_2": "CLIPTextModelWithProjection"}
    assert sdxl_tiny.weights["text_encoder"] == sum(module_bytes(sdxl_tiny.modules[name]) for name in encoders)
    fn, inputs = stage_call("sdxl-tiny", TEXT_ENCODE, sdxl_tiny.modules, 64, 64, torch.float32, sdxl_tiny._make)
    with sdxl_tiny.mode:
        hidden = fn(*inputs)
    assert tuple(hidden.shape) == (1, 77, clip_l.hidden_size + clip_g.hidden_size)


def test_sdxl_unet_step_takes_the_y_vector(sdxl_tiny):
    from sdopt.families import checkpoint_config

    config = checkpoint_config("sdxl-tiny")
    fn, inputs = stage_call("sdxl-tiny", UNET_STEP, sdxl_tiny.modules, 128, 64, torch.float32, sdxl_tiny._make)
    x, sigma, context, pooled, time_ids = inputs
    down = config.vae.downscale
    assert tuple(x.shape) == (2, 4, 64 // down, 128 // down) and tuple(context.shape) == (2, 77, config.diffusion_model.context_dim)
    # y = pooled CLIP-G text + six size and crop ids, each embedded to the same width: adm_in_channels in all.
    unet = sdxl_tiny.modules["unet"]
    assert tuple(pooled.shape) == (2, config.text_encoders[-1].projection_dim) and tuple(time_ids.shape) == (2, 6)
    assert pooled.shape[1] + 6 * unet.config.addition_time_embed_dim == config.diffusion_model.adm_in_channels
    stock = sdxl_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][0], 128, 128)
    # Sequential CFG must split y with the latent, or the UNet's batch-1 halves meet a batch-2 vector.
    low = sdxl_tiny.predict(UNET_STEP, lowmem_setting(1), 128, 128)
    assert 0 < low.peak_bytes < stock.peak_bytes
    assert stock.input_bytes == sum(t.numel() * t.element_size() for t in stage_call(
        "sdxl-tiny", UNET_STEP, sdxl_tiny.modules, 128, 128, torch.float32, sdxl_tiny._make)[1])


@pytest.fixture(scope="module", params=["sd35-tiny", "flux-tiny"])
def dit_tiny(request):
    return Planner(request.param)


def test_dit_text_encode_runs_the_family_s_text_encoders(dit_tiny):
    """SD3.5's encoders sit in its checkpoint, Flux's CLIP-L in a file of its own: both are run."""
    from sdopt.tools.plan import text_encoder_names, text_encoders

    texts = text_encoders(dit_tiny.model)
    assert texts and set(text_encoder_names(dit_tiny.model)) == {n for n in dit_tiny.modules if n.startswith("text_encoder")}
    assert dit_tiny.weights["text_encoder"] > 0
    fn, inputs = stage_call(dit_tiny.model, TEXT_ENCODE, dit_tiny.modules, 64, 64, torch.float32, dit_tiny._make)
    with dit_tiny.mode:
        hidden = fn(*inputs)
    assert tuple(hidden.shape) == (1, 77, sum(text.hidden_size for text in texts))


def test_dit_step_takes_diffusers_inputs_and_gives_back_the_latent(dit_tiny):
    from sdopt.families import FluxConfig, checkpoint_config

    config = checkpoint_config(dit_tiny.model)
    diffusion = config.diffusion_model
    # sd35-tiny's position grid (16 patches of 2 latent pixels, VAE downscale 2) bounds it at 64 px.
    width = 128 if isinstance(diffusion, FluxConfig) else 64
    fn, inputs = stage_call(dit_tiny.model, UNET_STEP, dit_tiny.modules, width, 64, torch.float32, dit_tiny._make)
    x, t, context, pooled, *flux_inputs = inputs
    down = config.vae.downscale
    assert tuple(x.shape) == (2, 16, 64 // down, width // down) and tuple(t.shape) == (2,)
    transformer = dit_tiny.modules["unet"].config
    assert tuple(context.shape) == (2, 77, transformer.joint_attention_dim)
    assert tuple(pooled.shape) == (2, transformer.pooled_projection_dim)
    if isinstance(diffusion, FluxConfig):
        image_ids, text_ids, guidance = flux_inputs
        tokens = (64 // down // diffusion.patch_size) * (width // down // diffusion.patch_size)
        assert (tuple(image_ids.shape), tuple(text_ids.shape), tuple(guidance.shape)) == ((tokens, 3), (77, 3), (2,))
    else:
        assert flux_inputs == []
    with dit_tiny.mode:
        assert fn(*inputs).shape == x.shape
    stock = dit_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][0], width, 64)
    # Sequential CFG runs the two halves one after the other (Flux's positions have no batch to split).
    sequential = dit_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][1], width, 64)
    assert 0 < sequential.peak_bytes < stock.peak_bytes


def test_flux_latent_packing_is_diffusers_own():
    from sdopt.tools.plan import pack_latent, unpack_latent

    latent = torch.randn(2, 16, 6, 10)
    packed = pack_latent(latent, 2)
    assert torch.equal(packed, diffusers.FluxPipeline._pack_latents(latent, 2, 16, 6, 10))
    assert torch.equal(unpack_latent(packed, latent.shape, 2), latent)
