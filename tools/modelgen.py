"""Deterministic random-weight SD1.5 checkpoints in the original single-file LDM layout.

No weights can be downloaded, so sdopt writes its own: ``model.diffusion_model.*``
(LDM UNet), ``cond_stage_model.transformer.text_model.*`` (HF CLIP text encoder) and
``first_stage_model.*`` (LDM AutoencoderKL), in one safetensors file. The key/shape
manifest is derived from an architecture config per size:

- ``full``: the real SD1.5 shapes.
- ``mini``: a smaller UNet that ComfyUI still detects as SD15, with the full text
  encoder and VAE (ComfyUI fixes their shapes).
- ``tiny``: everything small, for unit tests (not loadable by ComfyUI).

Each tensor depends only on (seed, key), so a given seed always gives the same file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..optim.precision import DTYPES

UNET_PREFIX = "model.diffusion_model."
TEXT_ENCODER_PREFIX = "cond_stage_model.transformer."
VAE_PREFIX = "first_stage_model."

CHECKPOINT_DTYPES = ("fp16", "fp32")
_SAFETENSORS_DTYPE_NAMES = {torch.float16: "F16", torch.float32: "F32"}

# Std of everything that is not a conv/linear weight or a norm scale: biases, embeddings, norm shifts.
_SMALL_STD = 0.02


@dataclass(frozen=True)
class UNetConfig:
    """LDM ``UNetModel`` hyper-parameters (``openaimodel.py``), SD1.5 by default."""

    in_channels: int = 4
    out_channels: int = 4
    model_channels: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    # Indices into channel_mult whose blocks carry a SpatialTransformer (LDM
    # attention_resolutions (4, 2, 1) are the downsampling factors 2**level).
    attention_levels: tuple[int, ...] = (0, 1, 2)
    transformer_depth: int = 1
    num_heads: int = 8
    context_dim: int = 768

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.model_channels


@dataclass(frozen=True)
class TextEncoderConfig:
    """HF ``CLIPTextModel`` hyper-parameters, CLIP ViT-L/14 (SD1.5) by default."""

    vocab_size: int = 49408
    max_position_embeddings: int = 77
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12


@dataclass(frozen=True)
class VAEConfig:
    """LDM ``AutoencoderKL`` ddconfig, SD1.5 by default."""

    in_channels: int = 3
    out_channels: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 4
    scaling_factor: float = 0.18215

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class CheckpointConfig:
    unet: UNetConfig
    text_encoder: TextEncoderConfig
    vae: VAEConfig
    # Default image side in pixels; the UNet's latent side is image_size // vae.downscale.
    image_size: int = 512


CONFIGS: dict[str, CheckpointConfig] = {
    # Mirrors SD1.5's structure (attention on all but the last level) at toy widths; the
    # full CLIP vocabulary stays so that any CLIP tokenizer's ids are valid.
    "tiny": CheckpointConfig(
        UNetConfig(
            model_channels=32,
            channel_mult=(1, 2),
            num_res_blocks=1,
            attention_levels=(0,),
            num_heads=2,
            context_dim=32,
        ),
        TextEncoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1),
        image_size=64,
    ),
    "mini": CheckpointConfig(
        UNetConfig(channel_mult=(1, 2), num_res_blocks=1, attention_levels=(0, 1)),
        TextEncoderConfig(),
        VAEConfig(),
    ),
    "full": CheckpointConfig(UNetConfig(), TextEncoderConfig(), VAEConfig()),
}
SIZES = tuple(CONFIGS)


def checkpoint_config(size: str) -> CheckpointConfig:
    try:
        return CONFIGS[size]
    except KeyError:
        raise UserError(f"unknown model size {size!r}: choose one of {', '.join(SIZES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Shape and initial distribution, normal(mean, std), of one checkpoint tensor."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _SpecBuilder:
    """Collects TensorSpecs by module, so each layer's keys and inits are written once."""

    def __init__(self) -> None:
        self.specs: dict[str, TensorSpec] = {}

    def _weight(self, name: str, shape: tuple[int, ...]) -> None:
        # std 1/sqrt(fan_in) keeps activations near unit scale layer after layer, so
        # even the full-depth networks stay finite in fp16.
        self.specs[f"{name}.weight"] = TensorSpec(shape, std=math.prod(shape[1:]) ** -0.5)

    def _bias(self, name: str, channels: int) -> None:
        self.specs[f"{name}.bias"] = TensorSpec((channels,), std=_SMALL_STD)

    def conv(self, name: str, out_channels: int, in_channels: int, kernel: int) -> None:
        self._weight(name, (out_channels, in_channels, kernel, kernel))
        self._bias(name, out_channels)

    def linear(self, name: str, out_features: int, in_features: int, bias: bool = True) -> None:
        self._weight(name, (out_features, in_features))
        if bias:
            self._bias(name, out_features)

    def norm(self, name: str, channels: int) -> None:
        # Scales near 1 and shifts near 0, but not exactly: equivalence tests of fused
        # norms should fail if the affine parameters are dropped.
        self.specs[f"{name}.weight"] = TensorSpec((channels,), std=_SMALL_STD, mean=1.0)
        self._bias(name, channels)

    def embedding(self, name: str, count: int, dim: int) -> None:
        self.specs[f"{name}.weight"] = TensorSpec((count, dim), std=_SMALL_STD)


def _unet_res_block(b: _SpecBuilder, name: str, in_channels: int, out_channels: int, time_embed_dim: int) -> None:
    b.norm(f"{name}.in_layers.0", in_channels)
    b.conv(f"{name}.in_layers.2", out_channels, in_channels, 3)
    b.linear(f"{name}.emb_layers.1", out_channels, time_embed_dim)
    b.norm(f"{name}.out_layers.0", out_channels)
    b.conv(f"{name}.out_layers.3", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.skip_connection", out_channels, in_channels, 1)


def _unet_spatial_transformer(b: _SpecBuilder, name: str, channels: int, cfg: UNetConfig) -> None:
    b.norm(f"{name}.norm", channels)
    # SD1.x uses 1x1 convs here; SD2 switched to linear (use_linear_in_transformer).
    b.conv(f"{name}.proj_in", channels, channels, 1)
    for depth in range(cfg.transformer_depth):
        block = f"{name}.transformer_blocks.{depth}"
        for attn, kv_dim in (("attn1", channels), ("attn2", cfg.context_dim)):
            b.linear(f"{block}.{attn}.to_q", channels, channels, bias=False)
            b.linear(f"{block}.{attn}.to_k", channels, kv_dim, bias=False)
            b.linear(f"{block}.{attn}.to_v", channels, kv_dim, bias=False)
            b.linear(f"{block}.{attn}.to_out.0", channels, channels)
        # GEGLU: one projection yields both the value and the gate, hence 2 x 4 x channels.
        b.linear(f"{block}.ff.net.0.proj", 2 * 4 * channels, channels)
        b.linear(f"{block}.ff.net.2", channels, 4 * channels)
        for norm in ("norm1", "norm2", "norm3"):
            b.norm(f"{block}.{norm}", channels)
    b.conv(f"{name}.proj_out", channels, channels, 1)


def unet_ldm_specs(cfg: UNetConfig) -> dict[str, TensorSpec]:
    """The LDM ``UNetModel`` state dict (keys without ``model.diffusion_model.``)."""
    b = _SpecBuilder()
    temb = cfg.time_embed_dim
    b.linear("time_embed.0", temb, cfg.model_channels)
    b.linear("time_embed.2", temb, temb)

    b.conv("input_blocks.0.0", cfg.model_channels, cfg.in_channels, 3)
    channels = cfg.model_channels
    skip_channels = [channels]  # what each input block hands to its mirror output block
    block = 1
    last_level = len(cfg.channel_mult) - 1
    for level, mult in enumerate(cfg.channel_mult):
        for _ in range(cfg.num_res_blocks):
            _unet_res_block(b, f"input_blocks.{block}.0", channels, cfg.model_channels * mult, temb)
            channels = cfg.model_channels * mult
            if level in cfg.attention_levels:
                _unet_spatial_transformer(b, f"input_blocks.{block}.1", channels, cfg)
            skip_channels.append(channels)
            block += 1
        if level != last_level:
            b.conv(f"input_blocks.{block}.0.op", channels, channels, 3)
            skip_channels.append(channels)
            block += 1

    _unet_res_block(b, "middle_block.0", channels, channels, temb)
    _unet_spatial_transformer(b, "middle_block.1", channels, cfg)
    _unet_res_block(b, "middle_block.2", channels, channels, temb)

    block = 0
    for level in reversed(range(len(cfg.channel_mult))):
        for index in range(cfg.num_res_blocks + 1):
            out_channels = cfg.model_channels * cfg.channel_mult[level]
            _unet_res_block(b, f"output_blocks.{block}.0", channels + skip_channels.pop(), out_channels, temb)
            channels = out_channels
            layer = 1
            if level in cfg.attention_levels:
                _unet_spatial_transformer(b, f"output_blocks.{block}.1", channels, cfg)
                layer = 2
            if level != 0 and index == cfg.num_res_blocks:
                b.conv(f"output_blocks.{block}.{layer}.conv", channels, channels, 3)
            block += 1

    b.norm("out.0", channels)
    b.conv("out.2", cfg.out_channels, channels, 3)
    return b.specs


def clip_text_specs(cfg: TextEncoderConfig) -> dict[str, TensorSpec]:
    """The HF ``CLIPTextModel`` state dict, with the ``text_model.`` key prefix of SD1.5 files.

    transformers >= 5.6 flattened CLIPTextModel, so its own keys lack that prefix.
    SD1.5 checkpoints carry neither ``position_ids`` (a non-persistent buffer) nor
    ``text_projection`` (which belongs to CLIPTextModelWithProjection).
    """
    b = _SpecBuilder()
    hidden = cfg.hidden_size
    b.embedding("text_model.embeddings.token_embedding", cfg.vocab_size, hidden)
    b.embedding("text_model.embeddings.position_embedding", cfg.max_position_embeddings, hidden)
    for index in range(cfg.num_hidden_layers):
        layer = f"text_model.encoder.layers.{index}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            b.linear(f"{layer}.self_attn.{proj}", hidden, hidden)
        b.norm(f"{layer}.layer_norm1", hidden)
        b.linear(f"{layer}.mlp.fc1", cfg.intermediate_size, hidden)
        b.linear(f"{layer}.mlp.fc2", hidden, cfg.intermediate_size)
        b.norm(f"{layer}.layer_norm2", hidden)
    b.norm("text_model.final_layer_norm", hidden)
    return b.specs


def _vae_res_block(b: _SpecBuilder, name: str, in_channels: int, out_channels: int) -> None:
    b.norm(f"{name}.norm1", in_channels)
    b.conv(f"{name}.conv1", out_channels, in_channels, 3)
    b.norm(f"{name}.norm2", out_channels)
    b.conv(f"{name}.conv2", out_channels, out_channels, 3)
    if in_channels != out_channels:
        b.conv(f"{name}.nin_shortcut", out_channels, in_channels, 1)


def _vae_mid(b: _SpecBuilder, name: str, channels: int) -> None:
    _vae_res_block(b, f"{name}.block_1", channels, channels)
    b.norm(f"{name}.attn_1.norm", channels)
    for proj in ("q", "k", "v", "proj_out"):
        b.conv(f"{name}.attn_1.{proj}", channels, channels, 1)
    _vae_res_block(b, f"{name}.block_2", channels, channels)


def vae_ldm_specs(cfg: VAEConfig) -> dict[str, TensorSpec]:
    """The LDM ``AutoencoderKL`` state dict (keys without ``first_stage_model.``)."""
    b = _SpecBuilder()
    widths = [cfg.ch * mult for mult in cfg.ch_mult]
    last_level = len(widths) - 1

    b.conv("encoder.conv_in", cfg.ch, cfg.in_channels, 3)
    channels = cfg.ch
    for level, width in enumerate(widths):
        for index in range(cfg.num_res_blocks):
            _vae_res_block(b, f"encoder.down.{level}.block.{index}", channels, width)
            channels = width
        if level != last_level:
            b.conv(f"encoder.down.{level}.downsample.conv", channels, channels, 3)
    _vae_mid(b, "encoder.mid", channels)
    b.norm("encoder.norm_out", channels)
    # The encoder predicts mean and log-variance (double_z), hence 2 x z_channels.
    b.conv("encoder.conv_out", 2 * cfg.z_channels, channels, 3)
    b.conv("quant_conv", 2 * cfg.z_channels, 2 * cfg.z_channels, 1)

    b.conv("post_quant_conv", cfg.z_channels, cfg.z_channels, 1)
    channels = widths[-1]
    b.conv("decoder.conv_in", channels, cfg.z_channels, 3)
    _vae_mid(b, "decoder.mid", channels)
    for level in reversed(range(len(widths))):
        for index in range(cfg.num_res_blocks + 1):
            _vae_res_block(b, f"decoder.up.{level}.block.{index}", channels, widths[level])
            channels = widths[level]
        if level != 0:
            b.conv(f"decoder.up.{level}.upsample.conv", channels, channels, 3)
    b.norm("decoder.norm_out", channels)
    b.conv("decoder.conv_out", cfg.out_channels, channels, 3)
    return b.specs


def checkpoint_specs(size: str) -> dict[str, TensorSpec]:
    """Every tensor of the single-file checkpoint for ``size``, with full LDM keys."""
    cfg = checkpoint_config(size)
    specs: dict[str, TensorSpec] = {}
    for prefix, part in (
        (UNET_PREFIX, unet_ldm_specs(cfg.unet)),
        (TEXT_ENCODER_PREFIX, clip_text_specs(cfg.text_encoder)),
        (VAE_PREFIX, vae_ldm_specs(cfg.vae)),
    ):
        specs.update({prefix + key: spec for key, spec in part.items()})
    return specs


def param_count(specs: dict[str, TensorSpec]) -> int:
    return sum(spec.numel for spec in specs.values())


def diffusers_unet_config(size: str) -> dict:
    """``UNet2DConditionModel(**kwargs)`` matching the UNet of ``size``."""
    cfg = checkpoint_config(size)
    unet = cfg.unet
    levels = range(len(unet.channel_mult))
    return {
        "sample_size": cfg.image_size // cfg.vae.downscale,
        "in_channels": unet.in_channels,
        "out_channels": unet.out_channels,
        "down_block_types": [
            "CrossAttnDownBlock2D" if level in unet.attention_levels else "DownBlock2D" for level in levels
        ],
        "up_block_types": [
            "CrossAttnUpBlock2D" if level in unet.attention_levels else "UpBlock2D" for level in reversed(levels)
        ],
        "block_out_channels": [unet.model_channels * mult for mult in unet.channel_mult],
        "layers_per_block": unet.num_res_blocks,
        "cross_attention_dim": unet.context_dim,
        # diffusers' legacy name: for SD1.x "attention_head_dim" holds the number of heads.
        "attention_head_dim": unet.num_heads,
        "transformer_layers_per_block": unet.transformer_depth,
    }


def diffusers_vae_config(size: str) -> dict:
    """``AutoencoderKL(**kwargs)`` matching the VAE of ``size``."""
    cfg = checkpoint_config(size)
    vae = cfg.vae
    return {
        "sample_size": cfg.image_size,
        "in_channels": vae.in_channels,
        "out_channels": vae.out_channels,
        "down_block_types": ["DownEncoderBlock2D"] * len(vae.ch_mult),
        "up_block_types": ["UpDecoderBlock2D"] * len(vae.ch_mult),
        "block_out_channels": [vae.ch * mult for mult in vae.ch_mult],
        "layers_per_block": vae.num_res_blocks,
        "latent_channels": vae.z_channels,
        "scaling_factor": vae.scaling_factor,
    }


def transformers_clip_text_config(size: str) -> dict:
    """``CLIPTextConfig(**kwargs)`` matching the text encoder of ``size``."""
    text = checkpoint_config(size).text_encoder
    return {
        "vocab_size": text.vocab_size,
        "max_position_embeddings": text.max_position_embeddings,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        # As in ComfyUI's sd1_clip_config.json (openai/clip-vit-large-patch14).
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
        "eos_token_id": 49407,
    }


def generate_tensor(key: str, spec: TensorSpec, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor stored under ``key``: a function of (seed, key) only, not of the other keys.

    Values are drawn in fp32 and then cast, so an fp16 checkpoint equals the fp32 one
    cast to fp16.
    """
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    values = torch.randn(spec.shape, generator=generator).mul_(spec.std).add_(spec.mean)
    return values.to(dtype)


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    size: str
    seed: int
    dtype: str
    tensor_count: int
    param_count: int
    file_bytes: int


def _checked_out_path(out: str | os.PathLike) -> Path:
    path = Path(out).expanduser()
    if path.is_dir():
        example = str(path / "model.safetensors")
        raise UserError(f"output path {str(path)!r} is a folder: give a file path such as {example!r}")
    if path.suffix != ".safetensors":
        example = str(path.with_suffix(".safetensors"))
        raise UserError(f"output path {str(path)!r} must end in .safetensors: e.g. {example!r}")
    return path


def _safetensors_header(specs: dict[str, TensorSpec], dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header; tensors follow back to back in key order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, dict] = {"__metadata__": metadata}
    offset = 0
    for key, spec in specs.items():
        end = offset + spec.numel * itemsize
        header[key] = {
            "dtype": _SAFETENSORS_DTYPE_NAMES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    # The format allows trailing spaces; padding to 8 bytes keeps the tensor data aligned.
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_checkpoint(
    size: str, out: str | os.PathLike, *, seed: int = 0, dtype: str = "fp16", progress: bool = False
) -> CheckpointSummary:
    """Write the ``size`` checkpoint to ``out`` (a .safetensors file) and describe it.

    Tensors are generated and streamed one at a time, so peak memory is one tensor,
    not the model. The file appears only when complete: it is written under a temporary
    name in the same folder and then renamed over ``out``.
    """
    if dtype not in CHECKPOINT_DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(CHECKPOINT_DTYPES)}")
    # Sorted like safetensors' own writer, so the bytes on disk depend on nothing but (size, seed, dtype).
    specs = dict(sorted(checkpoint_specs(size).items()))
    path = _checked_out_path(out)
    torch_dtype = DTYPES[dtype]
    metadata = {"format": "pt", "sdopt_size": size, "sdopt_seed": str(seed), "sdopt_dtype": dtype}

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: never clobber another writer's temp file; mode 0o666 lets the umask decide.
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise UserError(f"cannot create {str(path)!r}: {error.strerror or error}; choose a writable folder") from None

    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(_safetensors_header(specs, torch_dtype, metadata))
            tensors = tqdm(specs.items(), desc=f"sdopt {size} checkpoint", unit="tensor", disable=not progress)
            for key, spec in tensors:
                file.write(generate_tensor(key, spec, seed, torch_dtype).numpy())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = f"{error.strerror or error}; free some space or choose another folder"
            raise UserError(f"cannot write {str(path)!r}: {reason}") from None
        raise

    return CheckpointSummary(
        path=path,
        size=size,
        seed=seed,
        dtype=dtype,
        tensor_count=len(specs),
        param_count=param_count(specs),
        file_bytes=path.stat().st_size,
    )
