"""Stable Diffusion 1.5: LDM UNet with cross-attention on CLIP-L, 4-channel latent, the LDM VAE."""
from .family import (
    CheckpointConfig,
    DiffusionCall,
    Family,
    LatentFormat,
    TextEncoderConfig,
    UNetConfig,
    VAEConfig,
)

CLIP_L = TextEncoderConfig(prefix="cond_stage_model.transformer.")

SD15 = Family(
    name="sd15",
    title="SD1.5",
    comfy_configs=("SD15",),
    sizes={
        # SD1.5's structure (attention on all but the last level) at toy widths; the full CLIP
        # vocabulary stays so that any CLIP tokenizer's ids are valid. Not loadable by ComfyUI.
        "tiny": CheckpointConfig(
            UNetConfig(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, transformer_depth=(1, 0),
                       num_heads=2, context_dim=32),
            (TextEncoderConfig(prefix=CLIP_L.prefix, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4),),
            VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1),
            image_size=64,
        ),
        # A smaller UNet that ComfyUI still detects as SD15; text encoder and VAE at full size,
        # because ComfyUI fixes their shapes.
        "mini": CheckpointConfig(
            UNetConfig(channel_mult=(1, 2), num_res_blocks=1, transformer_depth=(1, 1)),
            (CLIP_L,),
            VAEConfig(),
        ),
        "full": CheckpointConfig(UNetConfig(), (CLIP_L,), VAEConfig()),
        # The reference model (tools/reference), trained on 64x64 scenes (an 8x8 latent) through the
        # block-mean VAE: two levels, so that at the 4x4 one every cell's convs reach the border (with one
        # level it drew every shape in the middle, as a blob); attention only there (on the input side and
        # in the last of its output blocks), no middle block: 27M parameters, so that the shipped weights
        # stay under 40 MB.
        "ref": CheckpointConfig(
            UNetConfig(channel_mult=(1, 1), num_res_blocks=1, transformer_depth=(0, 1), transformer_depth_middle=-2,
                       transformer_depth_output=(0, 0, 1, 0)),
            (CLIP_L,),
            VAEConfig(block_mean=True),
            image_size=64,
            trained=True,
        ),
    },
    latent=LatentFormat(channels=4, scale=0.18215),
    call=DiffusionCall(),
    bare_sizes=True,
)
