"""Stable Diffusion XL: LDM UNet with deep transformer stacks (2 and 10 blocks) on CLIP-L + OpenCLIP-G
text, a ``y`` vector of pooled text and size/crop embeddings, 4-channel latent, the LDM VAE (which
overflows fp16)."""
from .family import (
    CheckpointConfig,
    DiffusionCall,
    Family,
    LatentFormat,
    TextEncoderConfig,
    UNetConfig,
    VAEConfig,
)

CLIP_L = TextEncoderConfig(prefix="conditioner.embedders.0.transformer.")
CLIP_G = TextEncoderConfig(
    prefix="conditioner.embedders.1.model.",
    kind="open_clip",
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
)
# y = pooled CLIP-G text + (height, width, crop top, crop left, target height, target width), each
# a 256-wide sinusoidal embedding.
SIZE_EMBEDDING = 256
VECTOR = (("pooled text", 1280), ("original size", 2 * SIZE_EMBEDDING), ("crop", 2 * SIZE_EMBEDDING),
          ("target size", 2 * SIZE_EMBEDDING))

# ComfyUI detects SDXL by model_channels 320, linear transformer projections, input transformer
# depths (0, 0, 2, 2, 10, 10), context 2048 and y width 2816; widths, middle and output depths are free.
_SDXL_UNET = dict(model_channels=320, num_res_blocks=2, transformer_depth=(0, 2, 10), num_head_channels=64,
                  context_dim=2048, use_linear_in_transformer=True, adm_in_channels=2816)

SDXL = Family(
    name="sdxl",
    title="SDXL",
    comfy_configs=("SDXL",),
    sizes={
        # SDXL's structure (no attention on the first level, deeper stacks below, y input) at toy
        # widths, for unit tests; not loadable by ComfyUI.
        "tiny": CheckpointConfig(
            UNetConfig(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, transformer_depth=(0, 2),
                       transformer_depth_middle=2, num_head_channels=16, context_dim=64,
                       use_linear_in_transformer=True, adm_in_channels=32 + 6 * 8),
            (TextEncoderConfig(prefix=CLIP_L.prefix, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4),
             TextEncoderConfig(prefix=CLIP_G.prefix, kind="open_clip", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, hidden_act="gelu", projection_dim=32)),
            VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, fp16_overflow=True),
            image_size=64,
        ),
        # Detected as SDXL (input depths 0, 0, 2, 2, 10, 10 and its widths of context and y) with every
        # level 320 wide and one transformer block per output block. The middle keeps the last level's
        # 10 blocks, as in SDXL and as diffusers (plan, benches) can build it. Both text encoders and
        # the VAE at full size (ComfyUI fixes their shapes).
        "mini": CheckpointConfig(
            UNetConfig(**{**_SDXL_UNET, "channel_mult": (1, 1, 1), "transformer_depth_middle": 10,
                          "transformer_depth_output": (0, 1, 1)}),
            (CLIP_L, CLIP_G),
            VAEConfig(fp16_overflow=True),
            image_size=1024,
        ),
        "full": CheckpointConfig(
            UNetConfig(**{**_SDXL_UNET, "channel_mult": (1, 2, 4), "transformer_depth_middle": 10}),
            (CLIP_L, CLIP_G),
            VAEConfig(fp16_overflow=True),
            image_size=1024,
        ),
    },
    latent=LatentFormat(channels=4, scale=0.13025),
    call=DiffusionCall(vector="y", vector_parts=VECTOR),
)
