"""Per-architecture adapters: how a VAE's modules become the step graphs of its decode and encode.

An adapter knows one VAE architecture, named as a model family names it (``Family.vae_layout``,
e.g. ``ldm_autoencoder_kl``), in one implementation's modules (ComfyUI's/LDM's, diffusers'). It
recognizes those modules by their structure, never by a model family: SD1.5's and SDXL's VAEs
are the same architecture and take the same adapter. A VAE architecture that the adapters here
do not cover (the next VAE families) is one more adapter in ``ADAPTERS``.

Explicit walking of the known structure was chosen over torch.fx or a TorchFunctionMode: the
forward methods of these VAEs have data-dependent Python (dtype casts, optional blocks, batch
splitting) that tracing would bake in or trip on, and a step graph built from named submodules
says exactly which modules are supported; anything else raises ``UnsupportedVAE`` so a host can
run its own untiled path instead.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DECODE, UnsupportedVAE
from .graph import Graph, Value

LDM_AUTOENCODER_KL = "ldm_autoencoder_kl"


@dataclass(frozen=True)
class Layout:
    """One VAE's decode or encode as a step graph, with the module's own untiled call."""

    graph: Graph
    untiled: Callable[[torch.Tensor], torch.Tensor]
    factor: int  # image pixels per latent pixel


class VAEAdapter(ABC):
    """One VAE architecture in one implementation's modules.

    ``recognizes`` looks only for the parts that tell implementations apart (``parts``); ``layout``
    then checks every module it walks and raises ``UnsupportedVAE`` naming the first it cannot tile.
    """

    architecture: str
    implementation: str

    @abstractmethod
    def parts(self, kind: str) -> tuple[str, ...]:
        """The attributes of the decoder (``kind`` decode) or encoder that this implementation has."""

    def recognizes(self, coder: nn.Module, kind: str) -> bool:
        return all(hasattr(coder, name) for name in self.parts(kind))

    @abstractmethod
    def layout(self, model: nn.Module, coder: nn.Module, kind: str, channels: int) -> Layout:
        """The step graph of ``model``'s ``kind`` on a ``channels``-channel input."""


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation module as a function; SiLU in place, on the normalization's fresh output."""
    return _silu if type(module) is nn.SiLU else module


def _mode(x: torch.Tensor) -> torch.Tensor:
    """The diagonal Gaussian posterior's mode: the first half of the moments' channels."""
    return x[:, : x.shape[1] // 2]


def _require(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise UnsupportedVAE(f"{type(obj).__name__} has no {', '.join(missing)}")


class _AutoencoderKL(VAEAdapter):
    """The LDM ``AutoencoderKL`` architecture: encoder → quant_conv → diagonal Gaussian posterior,
    post_quant_conv → decoder (both convolutions optional, as in the 16-channel VAEs)."""

    architecture = LDM_AUTOENCODER_KL

    @abstractmethod
    def resamplings(self, coder: nn.Module, kind: str) -> int:
        """How many 2x up- (decode) or downsamplings the coder has."""

    @abstractmethod
    def decoder(self, g: Graph, dec: nn.Module, x: Value) -> Value: ...

    @abstractmethod
    def encoder(self, g: Graph, enc: nn.Module, x: Value) -> Value: ...

    @abstractmethod
    def posterior(self, g: Graph, model: nn.Module, moments: Value) -> Value:
        """What the untiled encode returns, from the moments."""

    @abstractmethod
    def untiled(self, model: nn.Module, kind: str) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def layout(self, model: nn.Module, coder: nn.Module, kind: str, channels: int) -> Layout:
        factor = 2 ** self.resamplings(coder, kind)
        if kind == DECODE:
            g = Graph(channels, 1)
            x = g.input
            if getattr(model, "post_quant_conv", None) is not None:
                x = g.conv(model.post_quant_conv, x)
            g.finish(self.decoder(g, coder, x))
            return Layout(g, self.untiled(model, kind), factor)
        g = Graph(channels, factor)
        x = self.encoder(g, coder, g.input)
        if getattr(model, "quant_conv", None) is not None:
            x = g.conv(model.quant_conv, x)
        g.finish(self.posterior(g, model, x))
        return Layout(g, self.untiled(model, kind), factor)


class LDMAutoencoderKL(_AutoencoderKL):
    """ComfyUI's (and LDM's) ``AutoencoderKL`` / ``AutoencodingEngine``: ``decoder.mid.block_1``,
    ``decoder.up[level].block``/``attn``/``upsample``; its ``encode`` returns the regularized latent."""

    implementation = "ComfyUI/LDM"

    def parts(self, kind: str) -> tuple[str, ...]:
        return ("mid", "up") if kind == DECODE else ("mid", "down")

    def resamplings(self, coder, kind):
        return sum(hasattr(s, "upsample" if kind == DECODE else "downsample") for s in (coder.up if kind == DECODE else coder.down))

    @staticmethod
    def _resnet(g: Graph, block, x: Value) -> Value:
        _require(block, "norm1", "conv1", "norm2", "conv2")
        shortcut = getattr(block, "nin_shortcut", None)
        if shortcut is None:
            shortcut = getattr(block, "conv_shortcut", None)
        if getattr(block, "in_channels", x.channels) == getattr(block, "out_channels", x.channels):
            shortcut = None
        return g.resnet(block, x, _silu, shortcut)

    @staticmethod
    def _upsample(g: Graph, up, x: Value) -> Value:
        if getattr(up, "scale_factor", 2.0) not in (2.0, (2.0, 2.0)):
            raise UnsupportedVAE(f"an upsampling by {up.scale_factor}")
        x = g.upsample(x)
        return g.conv(up.conv, x) if up.with_conv else x

    def _mid(self, g: Graph, mid, x: Value) -> Value:
        x = self._resnet(g, mid.block_1, x)
        x = g.whole(mid.attn_1, x)
        return self._resnet(g, mid.block_2, x)

    def _stage(self, g: Graph, stage, x: Value) -> Value:
        for index, block in enumerate(stage.block):
            x = self._resnet(g, block, x)
            if len(stage.attn) > 0:
                x = g.whole(stage.attn[index], x)
        return x

    def decoder(self, g, dec, x):
        _require(dec, "conv_in", "mid", "up", "norm_out", "conv_out")
        x = self._mid(g, dec.mid, g.conv(dec.conv_in, x))
        for level in reversed(range(len(dec.up))):
            stage = dec.up[level]
            x = self._stage(g, stage, x)
            if hasattr(stage, "upsample"):
                x = self._upsample(g, stage.upsample, x)
        if getattr(dec, "give_pre_end", False):
            return x
        x = g.conv(dec.conv_out, g.norm_act(dec.norm_out, _silu, x))
        return g.apply(torch.tanh, x) if getattr(dec, "tanh_out", False) else x

    def encoder(self, g, enc, x):
        _require(enc, "conv_in", "down", "mid", "norm_out", "conv_out")
        x = g.conv(enc.conv_in, x)
        for stage in enc.down:
            x = self._stage(g, stage, x)
            if hasattr(stage, "downsample"):
                if not stage.downsample.with_conv:
                    raise UnsupportedVAE("a downsampling by average pooling")
                x = g.downsample(stage.downsample.conv, x)
        x = self._mid(g, enc.mid, x)
        return g.conv(enc.conv_out, g.norm_act(enc.norm_out, _silu, x))

    def posterior(self, g, model, moments):
        regularizer = getattr(model, "regularization", None)
        name = type(regularizer).__name__
        if "DiagonalGaussian" in name and not getattr(regularizer, "sample", False):
            return g.apply(_mode, moments, moments.channels // 2)
        if name != "EmptyRegularizer":
            raise UnsupportedVAE(f"a {name} latent regularizer")
        return moments

    def untiled(self, model, kind):
        return model.decode if kind == DECODE else model.encode


class DiffusersAutoencoderKL(_AutoencoderKL):
    """diffusers' ``AutoencoderKL``: ``decoder.mid_block``, ``decoder.up_blocks[i].resnets``/``upsamplers``;
    its encode returns the posterior, whose mode is the latent."""

    implementation = "diffusers"

    def parts(self, kind: str) -> tuple[str, ...]:
        return ("mid_block", "up_blocks") if kind == DECODE else ("mid_block", "down_blocks")

    def resamplings(self, coder, kind):
        if kind == DECODE:
            return sum(len(s.upsamplers or ()) for s in coder.up_blocks)
        return sum(len(s.downsamplers or ()) for s in coder.down_blocks)

    @staticmethod
    def _resnet(g: Graph, block, x: Value) -> Value:
        _require(block, "norm1", "conv1", "norm2", "conv2", "nonlinearity")
        if getattr(block, "upsample", None) is not None or getattr(block, "downsample", None) is not None \
                or getattr(block, "time_emb_proj", None) is not None \
                or getattr(block, "time_embedding_norm", "default") not in ("default", "group"):
            raise UnsupportedVAE("a residual block that resamples or takes a time embedding")
        return g.resnet(block, x, _activation(block.nonlinearity), getattr(block, "conv_shortcut", None),
                        block.output_scale_factor)

    def _mid(self, g: Graph, mid, x: Value) -> Value:
        x = self._resnet(g, mid.resnets[0], x)
        for attention, block in zip(mid.attentions, mid.resnets[1:]):
            if attention is not None:
                x = g.whole(attention, x)
            x = self._resnet(g, block, x)
        return x

    def decoder(self, g, dec, x):
        _require(dec, "conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out")
        x = self._mid(g, dec.mid_block, g.conv(dec.conv_in, x))
        for stage in dec.up_blocks:
            if hasattr(stage, "attentions"):
                raise UnsupportedVAE(f"{type(stage).__name__} (attention in an up block)")
            for block in stage.resnets:
                x = self._resnet(g, block, x)
            for up in stage.upsamplers or ():
                if up.use_conv_transpose or not up.interpolate or getattr(up, "norm", None) is not None:
                    raise UnsupportedVAE("an upsampling that is not nearest 2x + convolution")
                x = g.upsample(x)
                if up.use_conv:
                    x = g.conv(up.conv if up.name == "conv" else up.Conv2d_0, x)
        return g.conv(dec.conv_out, g.norm_act(dec.conv_norm_out, _activation(dec.conv_act), x))

    def encoder(self, g, enc, x):
        _require(enc, "conv_in", "down_blocks", "mid_block", "conv_norm_out", "conv_act", "conv_out")
        x = g.conv(enc.conv_in, x)
        for stage in enc.down_blocks:
            if hasattr(stage, "attentions"):
                raise UnsupportedVAE(f"{type(stage).__name__} (attention in a down block)")
            for block in stage.resnets:
                x = self._resnet(g, block, x)
            for down in stage.downsamplers or ():
                if not down.use_conv or down.padding != 0 or getattr(down, "norm", None) is not None:
                    raise UnsupportedVAE("a downsampling that is not pad(0, 1, 0, 1) + strided convolution")
                x = g.downsample(down.conv, x)
        x = self._mid(g, enc.mid_block, x)
        return g.conv(enc.conv_out, g.norm_act(enc.conv_norm_out, _activation(enc.conv_act), x))

    def posterior(self, g, model, moments):
        return g.apply(_mode, moments, moments.channels // 2)

    def untiled(self, model, kind):
        if kind == DECODE:
            return lambda z: model.decode(z).sample
        return lambda pixels: model.encode(pixels).latent_dist.mode()


ADAPTERS: tuple[VAEAdapter, ...] = (LDMAutoencoderKL(), DiffusersAutoencoderKL())
ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(adapter.architecture for adapter in ADAPTERS))


def adapter_for(model: nn.Module, kind: str, architecture: str | None = None) -> VAEAdapter:
    """The adapter whose modules ``model``'s decoder (``kind`` decode) or encoder has; among those of
    ``architecture`` (a ``Family.vae_layout``) when given. Raises ``UnsupportedVAE`` saying why none fits."""
    if architecture is not None and architecture not in ARCHITECTURES:
        raise UnsupportedVAE(f"the {architecture!r} VAE layout: the tiled VAE has adapters for {', '.join(ARCHITECTURES)}")
    if getattr(model, "bn", None) is not None:
        raise UnsupportedVAE("a VAE with a latent batch norm")
    part = "decoder" if kind == DECODE else "encoder"
    coder = getattr(model, part, None)
    if coder is None:
        raise UnsupportedVAE(f"{type(model).__name__} has no {part}")
    candidates = [a for a in ADAPTERS if architecture is None or a.architecture == architecture]
    for adapter in candidates:
        if adapter.recognizes(coder, kind):
            return adapter
    looked = "; ".join(f"{a.implementation} {a.architecture}: {', '.join(a.parts(kind))}" for a in candidates)
    raise UnsupportedVAE(f"{type(coder).__name__} is no {part} the tiled VAE knows (looked for {looked})")


def layout_of(model: nn.Module, kind: str, channels: int, architecture: str | None = None) -> Layout:
    """The step graph of ``model``'s decode or encode (``kind``) on a ``channels``-channel input."""
    adapter = adapter_for(model, kind, architecture)
    return adapter.layout(model, getattr(model, "decoder" if kind == DECODE else "encoder"), kind, channels)
