"""Stable Diffusion 3.5: an MMDiT (joint text+image attention, one weight set per stream) on CLIP-L and
CLIP-G text padded to T5's width of 4096, a ``y`` vector of both pooled texts, the 16-channel VAE
without quant convs. ``medium`` is SD3.5 Medium's layout (24 blocks, MMDiT-X self-attention in the
first 13), ``full`` SD3.5 Large's (38 blocks).

T5-XXL (4.7B parameters) is left out of every generated checkpoint: ComfyUI's SD3 text encoder
runs without it, as it does for a real checkpoint saved without T5 (its context is CLIP's 77
tokens instead of 77 + 256)."""
from .family import (
    CheckpointConfig,
    DiffusionCall,
    Family,
    LatentFormat,
    MMDiTConfig,
    TextEncoderConfig,
    VAEConfig,
)

CLIP_L = TextEncoderConfig(prefix="text_encoders.clip_l.transformer.", projection_dim=768)
CLIP_G = TextEncoderConfig(prefix="text_encoders.clip_g.transformer.", hidden_size=1280, intermediate_size=5120,
                           num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu", projection_dim=1280)
VAE_16 = VAEConfig(z_channels=16, quant_conv=False)
# y = pooled CLIP-L + pooled CLIP-G; ComfyUI pads an absent encoder's part with zeros.
VECTOR = (("pooled CLIP-L", 768), ("pooled CLIP-G", 1280))

SD35 = Family(
    name="sd35",
    title="SD3.5",
    comfy_configs=("SD3",),
    sizes={
        # SD3.5 Medium's structure (RMS q/k norms, MMDiT-X on the first block) at toy widths, for
        # unit tests; not loadable by ComfyUI.
        "tiny": CheckpointConfig(
            MMDiTConfig(depth=2, context_dim=64, adm_in_channels=32 + 32, pos_embed_max_size=16,
                        x_block_self_attn_layers=(0,)),
            (TextEncoderConfig(prefix=CLIP_L.prefix, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, projection_dim=32),
             TextEncoderConfig(prefix=CLIP_G.prefix, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, hidden_act="gelu", projection_dim=32)),
            VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16, quant_conv=False),
            image_size=64,
        ),
        # Detected as SD3: 6 joint blocks 384 wide (6 heads), MMDiT-X on the first two, so
        # regional compile has identical blocks to reuse. CLIP-L only (the y vector's CLIP-G half
        # is zeros) to keep CI's checkpoint small; the 16-channel VAE at full size.
        "mini": CheckpointConfig(
            MMDiTConfig(depth=6, x_block_self_attn_layers=(0, 1)),
            (CLIP_L,),
            VAE_16,
            image_size=1024,
        ),
        "medium": CheckpointConfig(
            MMDiTConfig(depth=24, pos_embed_max_size=384, x_block_self_attn_layers=tuple(range(13))),
            (CLIP_L, CLIP_G),
            VAE_16,
            image_size=1024,
        ),
        "full": CheckpointConfig(MMDiTConfig(depth=38), (CLIP_L, CLIP_G), VAE_16, image_size=1024),
        # The reference model (tools/reference): an SD3 MMDiT of 4 joint blocks 256 wide, its stored
        # position grid cut to what 64x64 scenes (4x4 patches) need, trained through the block-mean VAE.
        "ref": CheckpointConfig(
            MMDiTConfig(depth=4, pos_embed_max_size=8),
            (CLIP_L,),
            VAEConfig(z_channels=16, quant_conv=False, block_mean=True),
            image_size=64,
            trained=True,
        ),
    },
    latent=LatentFormat(channels=16, scale=1.5305, shift=0.0609),
    call=DiffusionCall(vector="y", vector_parts=VECTOR, runs_wrappers=False),
    vae_layout="ldm_autoencoder_kl",
    repeated_blocks=("JointBlock",),
    block_groups=(("double_block", "joint_blocks"),),
    # its blocks never read their place: ComfyUI's options reach them as they are
    block_position_options=(),
    feedforward_modules=("Mlp",),
)
