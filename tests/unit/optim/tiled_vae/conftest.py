"""The VAEs the tiled-VAE tests tile: a narrow diffusers ``AutoencoderKL`` with SD1.5's layout
(4 levels, 8x downscale, mid-block attention), and a narrow VAE in ComfyUI's/LDM's module layout.

ComfyUI is never imported in the unit tier, so ``LDMAutoencoder`` is written here after ComfyUI's
``comfy.ldm.modules.diffusionmodules.model`` (``Encoder``/``Decoder``, ``ResnetBlock``, ``AttnBlock``,
``Upsample``, ``Downsample``) and ``comfy.ldm.models.autoencoder`` (``AutoencodingEngine``): the same
attribute names and the same forward; the host tier tiles ComfyUI's own modules.
"""
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from torch import nn

NARROW = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[16, 32, 32, 32], layers_per_block=1, latent_channels=4, norm_num_groups=8,
)
LATENT = (13, 18)  # odd sides: uneven tiles, the last row and column narrower


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(8, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1, self.conv1 = _norm(in_channels), nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2, self.conv2 = _norm(out_channels), nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if self.in_channels != self.out_channels else x) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        b, c, height, width = h.shape
        q, k, v = (conv(h).flatten(2).transpose(1, 2).unsqueeze(1) for conv in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(b, c, height, width)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.with_conv, self.scale_factor = True, 2.0
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.with_conv = True
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


def _stage(blocks, attentions, **resample) -> nn.Module:
    """One level: ``block`` and ``attn`` lists, and ``upsample=`` or ``downsample=`` where it resamples."""
    stage = nn.Module()
    stage.block, stage.attn = nn.ModuleList(blocks), nn.ModuleList(attentions)
    for name, module in resample.items():
        setattr(stage, name, module)
    return stage


def _mid(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(channels, channels), AttnBlock(channels), ResnetBlock(channels, channels)
    return mid


class Decoder(nn.Module):
    """``attn_levels``: the levels whose residual blocks are each followed by an attention block."""

    def __init__(self, ch, ch_mult, num_res_blocks, z_channels, out_ch=3, attn_levels=()):
        super().__init__()
        self.num_resolutions, self.num_res_blocks = len(ch_mult), num_res_blocks
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = _mid(block_in)
        self.up = nn.ModuleList()
        for level in reversed(range(len(ch_mult))):
            blocks, attentions = [], []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, ch * ch_mult[level]))
                block_in = ch * ch_mult[level]
                if level in attn_levels:
                    attentions.append(AttnBlock(block_in))
            self.up.insert(0, _stage(blocks, attentions, **({"upsample": Upsample(block_in)} if level else {})))
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(self.num_resolutions)):
            for index in range(self.num_res_blocks + 1):
                h = self.up[level].block[index](h)
                if len(self.up[level].attn) > 0:
                    h = self.up[level].attn[index](h)
            if level != 0:
                h = self.up[level].upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Encoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, z_channels, in_channels=3):
        super().__init__()
        self.num_resolutions = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in = ch
        for level, mult in enumerate(ch_mult):
            blocks = []
            for _ in range(num_res_blocks):
                blocks.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
            last = level == len(ch_mult) - 1
            self.down.append(_stage(blocks, [], **({} if last else {"downsample": Downsample(block_in)})))
        self.mid = _mid(block_in)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, 2 * z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for stage in self.down:
            for block in stage.block:
                h = block(h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class DiagonalGaussianRegularizer(nn.Module):
    def __init__(self, sample: bool = False):
        super().__init__()
        self.sample = sample

    def forward(self, z):
        mean, logvar = z.chunk(2, dim=1)
        return (mean + torch.randn_like(mean) * torch.exp(0.5 * logvar) if self.sample else mean), {}


class LDMAutoencoder(nn.Module):
    """``quant``: with ``quant_conv``/``post_quant_conv`` (SD1.5, SDXL), or without (16-channel VAEs)."""

    def __init__(self, ch=16, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, quant=True, attn_levels=(),
                 sample=False):
        super().__init__()
        self.encoder = Encoder(ch, ch_mult, num_res_blocks, z_channels)
        self.decoder = Decoder(ch, ch_mult, num_res_blocks, z_channels, attn_levels=attn_levels)
        self.regularization = DiagonalGaussianRegularizer(sample)
        if quant:
            self.quant_conv = nn.Conv2d(2 * z_channels, 2 * z_channels, 1)
            self.post_quant_conv = nn.Conv2d(z_channels, z_channels, 1)

    def encode(self, x):
        z = self.encoder(x)
        if hasattr(self, "quant_conv"):
            z = self.quant_conv(z)
        return self.regularization(z)[0]

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z) if hasattr(self, "post_quant_conv") else z)


@pytest.fixture(scope="package")
def vae():
    torch.manual_seed(0)
    return AutoencoderKL(**NARROW).eval()


@pytest.fixture(scope="package")
def latent():
    return torch.randn(2, 4, *LATENT, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)


@pytest.fixture(scope="package")
def reference(vae, latent):
    with torch.no_grad():
        return vae.decode(latent).sample


@pytest.fixture(scope="package")
def ldm_vae(ldm_autoencoder):
    """SD1.5/SDXL's VAE layout at toy widths (4x downscale), with attention after each up block of level 2."""
    return ldm_autoencoder(attn_levels=(2,))


@pytest.fixture(scope="package")
def make_vae():
    """A fresh seeded diffusers VAE of the narrow config, with ``overrides`` (a module to change freely)."""
    def make(**overrides):
        torch.manual_seed(0)
        return AutoencoderKL(**{**NARROW, **overrides}).eval()

    return make


@pytest.fixture(scope="package")
def ldm_autoencoder():
    """A fresh seeded ``LDMAutoencoder`` with the given config."""
    def make(**config):
        torch.manual_seed(0)
        return LDMAutoencoder(**config).eval()

    return make
