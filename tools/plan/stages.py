"""One stage of a model as a function and its input tensors: the text encode, one CFG step of a UNet or a
diffusion transformer as diffusers takes it, the VAE decode and encode, tiled or not."""
from __future__ import annotations

import torch

from ...families import FluxConfig, MMDiTConfig, UNetConfig, checkpoint_config
from .models import text_encoder_modules
from .settings import PROMPT_TOKENS, TEXT_ENCODE, UNET_STEP, VAE_DECODE, Setting


def _pooled_text_width(model: str) -> int:
    """The width of the pooled text in the vector input: the projection of the family's last text encoder."""
    return checkpoint_config(model).text_encoders[-1].projection_dim


def pack_latent(x: torch.Tensor, patch: int) -> torch.Tensor:
    """A (batch, channels, rows, columns) latent as Flux's tokens: (batch, patches, channels x patch²)."""
    batch, channels, rows, columns = x.shape
    return (x.view(batch, channels, rows // patch, patch, columns // patch, patch).permute(0, 2, 4, 1, 3, 5)
            .reshape(batch, (rows // patch) * (columns // patch), channels * patch * patch))


def unpack_latent(tokens: torch.Tensor, shape: torch.Size, patch: int) -> torch.Tensor:
    """``pack_latent``'s inverse: the tokens back into a latent of ``shape``."""
    batch, channels, rows, columns = shape
    return (tokens.view(batch, rows // patch, columns // patch, channels, patch, patch).permute(0, 3, 1, 4, 2, 5)
            .reshape(batch, channels, rows, columns))


def _transformer_step(model: str, transformer, latent: tuple[int, int, int], dtype: torch.dtype, make):
    """(function, inputs) of one CFG step of a diffusion transformer as diffusers takes it: the
    latent, the timesteps, the text tokens (``joint_attention_dim`` wide), the pooled text
    (``pooled_projection_dim``); Flux packs the latent into 2x2 patches inside the step (as
    ComfyUI's Flux does in its forward) and takes the tokens' positions and, where it has a
    guidance embedder, the guidance."""
    config = transformer.config
    inputs = (make((2, *latent), dtype), make((2,), dtype),
              make((2, PROMPT_TOKENS, config.joint_attention_dim), dtype), make((2, config.pooled_projection_dim), dtype))
    diffusion = checkpoint_config(model).diffusion_model
    if isinstance(diffusion, MMDiTConfig):
        return (lambda x, t, c, pooled: transformer(x, c, pooled, t).sample), inputs
    if not isinstance(diffusion, FluxConfig):
        raise TypeError(f"{model}: no diffusers step for a {type(diffusion).__name__}")
    patch = diffusion.patch_size
    tokens = (latent[1] // patch) * (latent[2] // patch)

    def step(x, t, c, pooled, image_ids, text_ids, *guidance):
        out = transformer(pack_latent(x, patch), c, pooled, t, image_ids, text_ids, *guidance).sample
        return unpack_latent(out, x.shape, patch)

    # Positions: (index, row, column) per token, no batch dimension (diffusers' current form).
    inputs += (make((tokens, 3), dtype), make((PROMPT_TOKENS, 3), dtype))
    if config.guidance_embeds:
        inputs += (make((2,), dtype),)
    return step, inputs


def stage_call(model: str, stage: str, modules: dict, width: int, height: int, dtype: torch.dtype, make,
               setting: Setting = Setting(""), prompt_tokens: int = PROMPT_TOKENS):
    """(function, input tensors) of one stage of ``model`` at ``width`` x ``height``; ``make(shape, dtype)``
    makes a tensor. ``prompt_tokens``: the text encode stage's prompt length."""
    from ...optim.tiled_vae import TiledVAEConfig, tiled_decode, tiled_encode

    vae = modules["vae"]
    down = 2 ** (len(vae.config.block_out_channels) - 1)
    latent = (vae.config.latent_channels, height // down, width // down)
    # Kept values in the compute dtype: the fp16 store checks each tile for overflow with .item(),
    # which fake tensors cannot answer; this over-states what the default fp16 store keeps.
    tiling = TiledVAEConfig(tile=setting.tile, budget_bytes=2**62, store_dtype=None) if setting.tile else None
    if stage == TEXT_ENCODE:
        encoders = text_encoder_modules(modules)
        # As ComfyUI does: each encoder in turn, their hidden states joined along the width.
        return (lambda ids: torch.cat([encoder(ids).last_hidden_state for encoder in encoders], dim=-1)), (
            make((1, prompt_tokens), torch.long),)
    if stage == UNET_STEP:
        unet = modules["unet"]
        if not isinstance(checkpoint_config(model).diffusion_model, UNetConfig):
            return _transformer_step(model, unet, latent, dtype, make)
        inputs = [make((2, *latent), dtype), make((2,), dtype), make((2, PROMPT_TOKENS, unet.config.cross_attention_dim), dtype)]
        if unet.config.addition_embed_type != "text_time":
            return (lambda x, t, c: unet(x, t, encoder_hidden_states=c).sample), tuple(inputs)
        # The vector input (SDXL's y) as diffusers takes it: the pooled text and the size and crop
        # ids, each of which the UNet embeds to addition_time_embed_dim.
        pooled = _pooled_text_width(model)
        ids = (unet.config.projection_class_embeddings_input_dim - pooled) // unet.config.addition_time_embed_dim
        inputs += [make((2, pooled), dtype), make((2, ids), dtype)]
        return (lambda x, t, c, text, time_ids: unet(x, t, encoder_hidden_states=c,
                                                     added_cond_kwargs={"text_embeds": text, "time_ids": time_ids}).sample), tuple(inputs)
    if stage == VAE_DECODE:
        if tiling:
            return (lambda z: tiled_decode(vae, z, tiling).output), (make((1, *latent), dtype),)
        return (lambda z: vae.decode(z).sample), (make((1, *latent), dtype),)
    if tiling:
        return (lambda x: tiled_encode(vae, x, tiling).output), (make((1, 3, height, width), dtype),)
    return (lambda x: vae.encode(x).latent_dist.mode()), (make((1, 3, height, width), dtype),)
