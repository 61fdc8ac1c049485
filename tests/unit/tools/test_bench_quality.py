"""tools.bench_quality without ComfyUI: model calls counted as the share of parameters that ran, PSNR and
SSIM from torchmetrics against the same seed's image, and the table's flags (a lossless rung whose
accuracy moved, a fewer-steps baseline)."""
from __future__ import annotations

import pytest
import torch

from sdopt.tools.bench_quality import ModelCallCounter, QualityRow, image_distance, quality_table


class TwoParts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.small = torch.nn.Linear(4, 4)  # 20 parameters
        self.large = torch.nn.Sequential(torch.nn.Linear(4, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))  # 60 + 52

    def forward(self, x, skip_large=False):
        x = self.small(x)
        return x if skip_large else self.large(x)


def test_a_whole_call_counts_one_and_a_partial_call_its_share_of_the_parameters():
    model = TwoParts()
    with ModelCallCounter(model) as counter:
        model(torch.ones(1, 4))
        model(torch.ones(1, 4), skip_large=True)
    assert counter.calls == pytest.approx(1 + 20 / 132)
    model(torch.ones(1, 4))  # hooks are gone after the block
    assert counter.calls == pytest.approx(1 + 20 / 132)


def test_psnr_and_ssim_of_an_image_against_itself_and_against_a_noisier_copy():
    generator = torch.Generator().manual_seed(0)
    reference = torch.rand(2, 64, 64, 3, generator=generator)
    assert image_distance(reference, reference) == pytest.approx((100.0, 1.0))
    slightly = (reference + 0.01 * torch.randn(reference.shape, generator=generator)).clamp(0, 1)
    more = (reference + 0.1 * torch.randn(reference.shape, generator=generator)).clamp(0, 1)
    psnr_slight, ssim_slight = image_distance(slightly, reference)
    psnr_more, ssim_more = image_distance(more, reference)
    assert psnr_slight == pytest.approx(40.0, abs=1.0)  # noise of std 0.01 on a range of 1: 40 dB
    assert psnr_more < psnr_slight and ssim_more < ssim_slight < 1.0


def _row(rung, shape_colour, **extra):
    return QualityRow(rung, "—", 8, 1.0, 1.0, 20.0, shape_colour, shape_colour, None, None, **extra)


def test_the_table_flags_a_lossless_rung_whose_accuracy_moved_and_names_the_baselines():
    table = quality_table([_row("stock", 0.9), _row("compile", 0.8, lossless=True), _row("attention", 0.9, lossless=True),
                           _row("stock, 7 steps", 0.7, baseline_of="deepcache 3")])
    lines = table.splitlines()
    assert "accuracy differs from stock's" in lines[3] and "accuracy differs" not in lines[4]
    assert "fewer-steps baseline of deepcache 3" in lines[5]
