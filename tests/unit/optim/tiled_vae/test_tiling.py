"""Tiled VAE decode and encode on CPU against the untiled module (the narrow diffusers VAE of
``conftest``, random seeded weights).

Exactness is checked with fp32 storage of the values kept between passes (only float rounding
differs); the default fp16 storage is held to a PSNR bound. Out-of-memory retries are driven by a
convolution that raises ``torch.OutOfMemoryError`` for inputs above a size, as an allocator would.
"""
import math

import pytest
import torch
from torch import nn

from sdopt.optim.tiled_vae import TiledVAEConfig, UnsupportedVAE, tiled_decode, tiled_encode, unsupported_reason

# fp32 storage: |tiled - untiled| on decoder outputs of magnitude ~1 (measured: up to 3e-6, from
# convolutions on other shapes and the combined GroupNorm statistics).
EXACT_ATOL = 2e-5
# fp16 storage of the kept values, as [0, 1] images (measured: about 70 dB on the full SD VAE).
FP16_MIN_PSNR_DB = 55
LATENT = (13, 18)  # conftest's latent sides
TILE = 64  # image pixels: a 2x3 grid on LATENT


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.double() - b.double()) / 2).square().mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("overlap", [0, 16])
def test_tiled_decode_matches_untiled(vae, latent, reference, keep, overlap):
    """Batch of two latents at different scales: GroupNorm statistics are per sample."""
    result = tiled_decode(vae, latent, TiledVAEConfig(tile=TILE, overlap=overlap, keep_intermediates=keep, store_dtype=None))
    assert result.stats.tiled and result.stats.grid == (2, 3) and result.stats.tile == TILE
    assert result.stats.kept_intermediates is keep
    assert (result.stats.store_dtype, result.stats.stored, result.stats.stored_wide) == (None, 0, 0)
    assert result.output.shape == reference.shape
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL


def test_fp16_storage_stays_close(vae, latent, reference):
    result = tiled_decode(vae, latent, TiledVAEConfig(tile=TILE))
    assert psnr(result.output, reference) >= FP16_MIN_PSNR_DB
    stats = result.stats
    assert stats.stored > 0 and stats.stored_wide == 0 and "past fp16" not in stats.describe()


def test_values_beyond_fp16_are_stored_wide_and_counted(make_vae, latent):
    """Activations past fp16's range (65504), as the SDXL VAE's, are kept in the compute dtype,
    tile by tile, and the stats say how many."""
    loud = make_vae()
    with torch.no_grad():
        loud.decoder.conv_in.weight.mul_(1e6)
        loud.decoder.conv_in.bias.mul_(1e6)
        assert loud.decoder.conv_in(latent).abs().max() > 1e5
        reference = loud.decode(latent).sample
    result = tiled_decode(loud, latent, TiledVAEConfig(tile=TILE))
    assert torch.isfinite(result.output).all()
    assert psnr(result.output, reference) >= FP16_MIN_PSNR_DB
    stats = result.stats
    assert 0 < stats.stored_wide < stats.stored and (stats.store_dtype, stats.compute_dtype) == ("fp16", "fp32")
    assert f"{stats.stored_wide} of {stats.stored} stored tile values past fp16's range kept in fp32" in stats.describe()


def test_tiled_encode_matches_untiled(vae):
    pixels = torch.rand(2, 3, 104, 144, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        reference = vae.encode(pixels).latent_dist.mode()
    result = tiled_encode(vae, pixels, TiledVAEConfig(tile=TILE, store_dtype=None))
    assert result.stats.grid == (2, 3)
    assert result.output.shape == reference.shape == (2, 4, 13, 18)
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL


def test_encode_needs_sides_in_multiples_of_the_downscale(vae):
    with pytest.raises(UnsupportedVAE, match="multiples of 8"):
        tiled_encode(vae, torch.zeros(1, 3, 100, 64), TiledVAEConfig(tile=TILE))


class _OOMAbove(nn.Conv2d):
    """A convolution whose allocations fail, like CUDA's, for inputs larger than ``pixels``."""

    def __init__(self, conv: nn.Conv2d, pixels: int):
        super().__init__(conv.in_channels, conv.out_channels, conv.kernel_size, padding=conv.padding)
        self.load_state_dict(conv.state_dict())
        self.pixels, self.calls = pixels, []

    def forward(self, x):
        self.calls.append(tuple(x.shape[-2:]))
        if x.shape[-2] * x.shape[-1] > self.pixels:
            raise torch.OutOfMemoryError("fake allocator: tile too large")
        return super().forward(x)


def _with_failing_conv_out(make_vae, pixels: int):
    model = make_vae()
    model.decoder.conv_out = _OOMAbove(model.decoder.conv_out, pixels)
    return model


def test_out_of_memory_retries_with_smaller_tiles(make_vae, latent, reference):
    model = _with_failing_conv_out(make_vae, 80 * 80)  # a 64 px tile with its halo passes, a 128 px one does not
    result = tiled_decode(model, latent, TiledVAEConfig(tile=256, store_dtype=None))
    stats = result.stats
    assert (stats.oom_retries, stats.tiles_tried, stats.tile) == (2, (256, 128, 64), 64)
    assert "2 OOM retries (tile 256 → 128 → 64 px)" in stats.describe()
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL


def test_out_of_memory_at_the_smallest_tile_is_raised(make_vae, latent):
    model = _with_failing_conv_out(make_vae, 8 * 8)
    with pytest.raises(torch.OutOfMemoryError):
        tiled_decode(model, latent, TiledVAEConfig(tile=128))
    assert model.decoder.conv_out.calls, "the failing convolution was reached"


def test_auto_tile_is_the_largest_that_fits_the_budget(vae, latent):
    roomy = tiled_decode(vae, latent, TiledVAEConfig(budget_bytes=2**40))
    assert roomy.stats.grid == (1, 1) and roomy.stats.kept_intermediates
    budget = roomy.stats.estimated_peak_bytes // 2
    tight = tiled_decode(vae, latent, TiledVAEConfig(budget_bytes=budget, keep_intermediates=True))
    assert tight.stats.tiles > 1 and tight.stats.estimated_peak_bytes <= budget
    # Auto tries one tile per distinct grid, ceil(longest latent side / n) for n = 1, 2, ...
    sides = sorted({-(-max(LATENT) // n) for n in range(1, max(LATENT) + 1)}, reverse=True)
    larger = sides[sides.index(tight.stats.tile // 8) - 1] * 8
    bigger_tile = tiled_decode(vae, latent, TiledVAEConfig(tile=larger, keep_intermediates=True))
    assert bigger_tile.stats.estimated_peak_bytes > budget, "the next larger tile would also have fitted"


def test_only_when_needed_runs_untiled_when_it_fits(vae, latent, reference):
    fits = tiled_decode(vae, latent, TiledVAEConfig(only_when_needed=True, budget_bytes=2**40))
    assert not fits.stats.tiled and fits.stats.reason.startswith("fits:")
    assert torch.equal(fits.output, reference)
    tight = tiled_decode(vae, latent, TiledVAEConfig(only_when_needed=True, budget_bytes=fits.stats.untiled_estimate_bytes - 1))
    assert tight.stats.tiled


def test_without_a_budget_the_hosts_free_memory_decides(vae, latent):
    untiled = tiled_decode(vae, latent, TiledVAEConfig(only_when_needed=True, budget_bytes=2**40)).stats.untiled_estimate_bytes
    asked = []

    def host_free(device):
        asked.append(torch.device(device))
        return untiled - 1

    result = tiled_decode(vae, latent, TiledVAEConfig(only_when_needed=True, free_bytes=host_free))
    assert asked == [latent.device]
    assert result.stats.tiled and result.stats.budget_bytes == untiled - 1


def test_progress_counts_every_tile_of_every_pass(vae, latent):
    calls = []
    result = tiled_decode(vae, latent, TiledVAEConfig(tile=TILE), progress=lambda done, total: calls.append((done, total)))
    total = result.stats.passes * result.stats.tiles
    assert calls == [(n, total) for n in range(1, total + 1)]


def test_the_module_is_left_as_it_was(make_vae, latent):
    model = make_vae()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tiled_decode(model, latent, TiledVAEConfig(tile=TILE))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_unknown_layouts_are_refused(vae, make_vae):
    assert unsupported_reason(vae, "decode") is None and unsupported_reason(vae, "encode") is None
    assert "has no decoder" in unsupported_reason(nn.Conv2d(4, 4, 3), "decode")
    with_attention = make_vae(up_block_types=["AttnUpDecoderBlock2D"] * 4)
    assert "attention in an up block" in unsupported_reason(with_attention, "decode")
    with pytest.raises(UnsupportedVAE):
        tiled_decode(with_attention, torch.zeros(1, 4, 8, 8))


def test_an_untiled_decode_that_runs_out_of_memory_is_tiled(make_vae, latent, reference):
    model = _with_failing_conv_out(make_vae, 80 * 80)
    result = tiled_decode(model, latent, TiledVAEConfig(only_when_needed=True, budget_bytes=2**40, tile=64, store_dtype=None))
    assert result.stats.tiled and (result.stats.oom_retries, result.stats.tiles_tried) == (1, (144, 64))
    assert (result.output - reference).abs().max().item() <= EXACT_ATOL
