"""Flux.1: a rectified-flow DiT of double-stream blocks (image and text weights apart, joint
attention) and single-stream blocks, rotary positions, the 16-channel VAE under ``vae.``. ``full``
is Flux.1-dev's layout (19 + 38 blocks, distilled guidance input), ``schnell`` the same without it.

A Flux checkpoint's text encoder is T5-XXL (4.7B parameters, its shape fixed by ComfyUI) with
CLIP-L's pooled output as ``y``. Too large to generate for CI, so sdopt's Flux takes CLIP-L for both:
its token states (77 x 768, hence ``context_in_dim`` 768) and its pooled output, from a text encoder
file of its own that ComfyUI's ``CLIPLoader`` loads (type ``stable_diffusion``). ComfyUI's
checkpoint loader builds T5-XXL for any Flux checkpoint that carries a text encoder, so the
checkpoint carries none. Against the real model this changes only ``txt_in``'s input width and
the text length (77 tokens instead of 256 or 512)."""
from .family import (
    CheckpointConfig,
    DiffusionCall,
    Family,
    FluxConfig,
    LatentFormat,
    TextEncoderConfig,
    VAEConfig,
)

CLIP_L = TextEncoderConfig(prefix="", projection_dim=768)
VAE_16 = VAEConfig(z_channels=16, quant_conv=False)
_TEXT = dict(context_in_dim=CLIP_L.hidden_size, vec_in_dim=CLIP_L.hidden_size)

FLUX = Family(
    name="flux",
    title="Flux",
    comfy_configs=("Flux", "FluxSchnell"),
    sizes={
        # Flux's structure at a toy width (4 heads of 16): unit tests only, not loadable by ComfyUI.
        "tiny": CheckpointConfig(
            FluxConfig(depth=1, depth_single_blocks=2, hidden_size=64, num_heads=4, context_in_dim=32, vec_in_dim=32),
            (),
            VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16, quant_conv=False),
            image_size=64,
            vae_prefix="vae.",
            separate_text_encoders=(TextEncoderConfig(prefix="", hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=4),),
        ),
        # Detected as Flux.1-dev: one double and one single block at the real width (3072, 24
        # heads), 0.53B parameters.
        "mini": CheckpointConfig(FluxConfig(depth=1, depth_single_blocks=1, **_TEXT), (), VAE_16, image_size=1024,
                                 vae_prefix="vae.", separate_text_encoders=(CLIP_L,)),
        "schnell": CheckpointConfig(FluxConfig(depth=19, depth_single_blocks=38, guidance_embed=False, **_TEXT), (),
                                    VAE_16, image_size=1024, vae_prefix="vae.", separate_text_encoders=(CLIP_L,)),
        "full": CheckpointConfig(FluxConfig(depth=19, depth_single_blocks=38, **_TEXT), (), VAE_16, image_size=1024,
                                 vae_prefix="vae.", separate_text_encoders=(CLIP_L,)),
    },
    latent=LatentFormat(channels=16, scale=0.3611, shift=0.1159),
    call=DiffusionCall(tensor_inputs=("x", "timestep", "context", "y", "guidance", "ref_latents"), vector="y",
                       vector_parts=(("pooled text", CLIP_L.hidden_size),)),
    repeated_blocks=("DoubleStreamBlock", "SingleStreamBlock"),
    block_groups=(("double_block", "double_blocks"), ("single_block", "single_blocks")),
    # its blocks never read their place: ComfyUI's options reach them as they are
    block_position_options=(),
    # The double blocks' MLPs (nn.Sequential, so by attribute name); a single block fuses its MLP
    # with attention's projections, so it has none to slice apart.
    feedforward_modules=("img_mlp", "txt_mlp"),
    clip_type="stable_diffusion",
)
