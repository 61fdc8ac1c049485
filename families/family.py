"""What one model family is, as data: the checkpoint's parts and their configs, how ComfyUI calls
the diffusion model, the latent format, the VAE layout, the text encoders and the repeated blocks.

Techniques, nodes and tools ask a ``Family`` for these instead of assuming SD1.5; none branches on
a family's name. One module per family (``families/sd15.py``, ``sdxl.py``, ``sd35.py``, ``flux.py``) builds its
``Family``; ``families/__init__.py`` registers it.
"""
from __future__ import annotations

from dataclasses import dataclass

# Where each part sits in an original single-file checkpoint.
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."


@dataclass(frozen=True)
class UNetConfig:
    """LDM ``UNetModel`` hyper-parameters (ComfyUI's ``openaimodel.py``).

    ``transformer_depth`` gives, per level of ``channel_mult``, the transformer blocks in each
    SpatialTransformer of the input side (0: that level has no attention); ``transformer_depth_output``
    the same for the output side, one per level or, as ComfyUI reads it, one per output block (level 0's
    ``num_res_blocks + 1`` first; None: as the input side), and ``transformer_depth_middle`` for the
    middle block. Heads come from ``num_heads`` or, when set, ``num_head_channels`` (SDXL: 64).
    ``adm_in_channels`` is the width of the ``y`` vector input (None: the model takes no ``y``).
    """

    in_channels: int = 4
    out_channels: int = 4
    model_channels: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    transformer_depth: tuple[int, ...] = (1, 1, 1, 0)
    transformer_depth_middle: int = 1
    transformer_depth_output: tuple[int, ...] | None = None
    num_heads: int = 8
    num_head_channels: int | None = None
    context_dim: int = 768
    use_linear_in_transformer: bool = False
    adm_in_channels: int | None = None

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.model_channels

    @property
    def output_block_depths(self) -> tuple[int, ...]:
        """Each output block's transformer depth in ComfyUI's order: level 0's blocks first (the model
        builds its output blocks, deepest level first, by popping this list)."""
        depths = self.transformer_depth if self.transformer_depth_output is None else self.transformer_depth_output
        per_level = self.num_res_blocks + 1
        if len(depths) == len(self.channel_mult):
            return tuple(depth for depth in depths for _ in range(per_level))
        if len(depths) != len(self.channel_mult) * per_level:
            raise ValueError(f"transformer_depth_output: {len(depths)} depths; give one per level "
                             f"({len(self.channel_mult)}) or one per output block ({len(self.channel_mult) * per_level})")
        return tuple(depths)

    def heads(self, channels: int) -> int:
        return channels // self.num_head_channels if self.num_head_channels else self.num_heads


@dataclass(frozen=True)
class TextEncoderConfig:
    """One text encoder of a checkpoint: its key prefix, its state-dict format and its size.

    ``kind`` is ``hf_clip`` (transformers' ``CLIPTextModel`` keys, ``text_model.*``) or ``open_clip``
    (OpenCLIP's ``transformer.resblocks.*`` keys with a ``text_projection``, SDXL's CLIP-G).
    ``projection_dim`` is the pooled output's width where the encoder has a text projection (in
    ``hf_clip`` format a ``text_projection.weight``, as in CLIPTextModelWithProjection and SD3's files).
    """

    prefix: str
    kind: str = "hf_clip"
    vocab_size: int = 49408
    max_position_embeddings: int = 77
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_act: str = "quick_gelu"
    projection_dim: int | None = None


@dataclass(frozen=True)
class VAEConfig:
    """LDM ``AutoencoderKL`` ddconfig.

    ``quant_conv``: the 1x1 convs around the latent (SD1.5, SDXL); the 16-channel VAEs of SD3 and
    Flux have none. ``fp16_overflow``: the decoder's activations before its GroupNorms exceed fp16's range, as the
    real SDXL VAE's do (the fp16 black image); in fp32 and bf16 the norms bring them back, so the
    image is unchanged. ``block_mean``: the hand-built VAE of the reference models, whose latent is each
    block's mean colour (``tools/modelgen/block_mean_vae.py``) instead of random weights.
    """

    in_channels: int = 3
    out_channels: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 4
    quant_conv: bool = True
    fp16_overflow: bool = False
    block_mean: bool = False

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class MMDiTConfig:
    """ComfyUI's MMDiT (SD3, SD3.5; ``mmdit.py``): ``depth`` joint blocks of width 64 x depth with
    ``depth`` heads of 64, as ComfyUI derives them from the patch embedding's width. The last joint
    block's text half is ``pre_only`` (attention inputs only). ``x_block_self_attn_layers``: the
    blocks whose image half has a second self-attention (SD3.5 Medium's MMDiT-X). ``qk_norm``: RMS
    norms on q and k (SD3.5). ``pos_embed_max_size``: the side, in patches, of the stored position
    grid, which bounds the largest latent."""

    depth: int
    in_channels: int = 16
    patch_size: int = 2
    context_dim: int = 4096
    adm_in_channels: int = 2048
    pos_embed_max_size: int = 192
    qk_norm: bool = True
    x_block_self_attn_layers: tuple[int, ...] = ()
    mlp_ratio: int = 4

    @property
    def hidden_size(self) -> int:
        return 64 * self.depth


@dataclass(frozen=True)
class FluxConfig:
    """ComfyUI's Flux (``ldm/flux/model.py``): ``depth`` double-stream blocks (image and text with
    their own weights, joint attention) then ``depth_single_blocks`` single-stream blocks.
    ComfyUI detects Flux with 24 heads whose rotary axes (16, 56, 56) fill 128 channels, so the
    width is 3072 in every Flux it loads; a smaller ``hidden_size`` is for unit tests only.
    ``guidance_embed``: dev's distilled guidance input (schnell has none)."""

    depth: int
    depth_single_blocks: int
    hidden_size: int = 3072
    num_heads: int = 24
    mlp_ratio: int = 4
    in_channels: int = 16
    patch_size: int = 2
    context_in_dim: int = 4096
    vec_in_dim: int = 768
    guidance_embed: bool = True
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


DiffusionModelConfig = UNetConfig | MMDiTConfig | FluxConfig


@dataclass(frozen=True)
class CheckpointConfig:
    """The parts of one generated checkpoint. ``image_size``: default image side in pixels.

    ``text_encoders`` sit in the checkpoint; ``separate_text_encoders`` in a file of their own
    (``Family.text_encoder_filename``) that ComfyUI's ``CLIPLoader`` loads as ``Family.clip_type``,
    for families whose checkpoint loader would otherwise build a text encoder too large to generate
    (Flux's T5-XXL). ``vae_prefix``: where the VAE sits in the checkpoint. ``trained``: a reference
    model, whose diffusion model was trained here (``python -m sdopt train-reference``) and ships with
    sdopt; its model name puts the size first (``ref-sd15``)."""

    diffusion_model: DiffusionModelConfig
    text_encoders: tuple[TextEncoderConfig, ...]
    vae: VAEConfig
    image_size: int = 512
    vae_prefix: str = VAE_PREFIX
    separate_text_encoders: tuple[TextEncoderConfig, ...] = ()
    trained: bool = False


@dataclass(frozen=True)
class LatentFormat:
    """The latent the VAE encodes to: ``latent = (vae_latent - shift) * scale``."""

    channels: int = 4
    scale: float = 0.18215
    shift: float = 0.0


@dataclass(frozen=True)
class DiffusionCall:
    """How ComfyUI calls the diffusion model: the tensor inputs of its forward, in positional order,
    before ``control`` and ``transformer_options``. ``vector`` names the pooled-text/size vector
    input where there is one (SDXL's ``y``: pooled CLIP-G text 1280 + 6 size and crop embeddings of
    256 = 2816), and ``vector_parts`` spells out its width. ``runs_wrappers``: ComfyUI runs its
    DIFFUSION_MODEL wrappers around this forward (its MMDiT wrapper for SD3 does not)."""

    tensor_inputs: tuple[str, ...] = ("x", "timesteps", "context", "y")
    vector: str | None = None
    vector_parts: tuple[tuple[str, int], ...] = ()
    runs_wrappers: bool = True

    @property
    def plain_forward(self) -> str:
        """The method that runs the diffusion model without ComfyUI's wrappers: ``_forward`` where
        its ``forward`` runs them, else ``forward`` itself."""
        return "_forward" if self.runs_wrappers else "forward"


@dataclass(frozen=True)
class Family:
    """One model family.

    ``name`` is the short name used in model names (``sdxl-mini``); ``bare_sizes`` families (SD1.5)
    also answer to the bare size (``mini``). ``comfy_configs`` are the names of ComfyUI's
    ``supported_models`` classes that belong to it (subclasses included). ``vae_layout`` names the
    VAE architecture for the tiled VAE's adapters. ``repeated_blocks`` are the class names of the
    blocks that repeat in the diffusion model (regional compile's unit: each class is compiled once,
    so a small model with one block of a kind still compiles that block; a UNet's resamplers are
    among them); ``feedforward_modules``
    those of its token-wise feed-forwards (Low Memory slices them over tokens; an attribute name such as
    ``img_mlp`` where their class is generic). ``block_groups`` are a transformer's chains of blocks in
    the order its forward runs them, each as (ComfyUI's ``dit`` block-patch name, the attribute that
    holds them): First Block Cache's unit. ``block_position_options`` are the ``transformer_options``
    keys that ComfyUI sets per block (its place in the model, or what one block leaves for the next)
    and that the blocks read only to look up patches keyed by place (a UNet's SpatialTransformer);
    regional compile leaves them out where no such patch is set, so alike blocks share one compiled
    entry. ``clip_type`` is the ``CLIPLoader`` type that loads a size's ``separate_text_encoders``.
    """

    name: str
    title: str
    comfy_configs: tuple[str, ...]
    sizes: dict[str, CheckpointConfig]
    latent: LatentFormat
    call: DiffusionCall
    vae_layout: str = "ldm_autoencoder_kl"
    repeated_blocks: tuple[str, ...] = ("ResBlock", "SpatialTransformer", "Downsample", "Upsample")
    feedforward_modules: tuple[str, ...] = ("FeedForward",)
    block_groups: tuple[tuple[str, str], ...] = ()
    block_position_options: tuple[str, ...] = ("block", "block_index", "transformer_index", "activations_shape")
    bare_sizes: bool = False
    clip_type: str = "stable_diffusion"

    def model_name(self, size: str) -> str:
        if self.sizes[size].trained:
            return f"{size}-{self.name}"
        return size if self.bare_sizes else f"{self.name}-{size}"

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(self.model_name(size) for size in self.sizes)

    def checkpoint_filename(self, size: str) -> str:
        return f"sdopt-{size}-{self.name}.safetensors"

    def text_encoder_filename(self, size: str) -> str | None:
        """The file of size ``size``'s ``separate_text_encoders`` (for ComfyUI's text_encoders
        folder), None where its checkpoint carries them all."""
        return f"sdopt-{size}-{self.name}-text.safetensors" if self.sizes[size].separate_text_encoders else None
