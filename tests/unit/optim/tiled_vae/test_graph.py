"""The regions a step's output region needs of its input: the halo of a convolution, the pad of a
stride-2 downsample, half the region for a 2x upsample; each step computes exactly that region."""
import pytest
import torch
from torch import nn

from sdopt.optim.tiled_vae import UnsupportedVAE
from sdopt.optim.tiled_vae.graph import Conv, Downsample, Upsample, crop

SIZE = (16, 20)


@pytest.mark.parametrize("region", [(0, 4, 0, 6), (2, 8, 3, 10), (5, 8, 0, 10)])  # within every output (8x10 and up)
def test_each_step_computes_its_region_from_the_input_region_it_needs(region):
    torch.manual_seed(0)
    x = torch.randn(1, 2, *SIZE)
    conv, down = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(2, 3, 3, stride=2)
    whole = {
        Conv(conv): conv(x),
        Downsample(down): down(nn.functional.pad(x, (0, 1, 0, 1))),
        Upsample(2): nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"),
    }
    for step, full in whole.items():
        out_size, r = full.shape[-2:], region
        need = step.need(r, SIZE)
        have = crop(x, (0, SIZE[0], 0, SIZE[1]), need)
        with torch.no_grad():
            part = step.run([have], need, r)
            torch.testing.assert_close(part, crop(full, (0, out_size[0], 0, out_size[1]), r), rtol=0, atol=1e-6)


def test_the_halo_of_a_convolution_is_its_padding_clipped_to_the_image():
    assert Conv(nn.Conv2d(2, 2, 3, padding=1)).need((4, 8, 0, 8), SIZE) == (3, 9, 0, 9)
    assert Conv(nn.Conv2d(2, 2, 1)).need((4, 8, 0, 8), SIZE) == (4, 8, 0, 8)
    assert Downsample(nn.Conv2d(2, 2, 3, stride=2)).need((2, 8, 0, 4), SIZE) == (4, 16, 0, 9)
    assert Upsample(2).need((3, 9, 0, 8), SIZE) == (1, 5, 0, 4)


@pytest.mark.parametrize("conv", [nn.Conv2d(2, 2, 3, padding=2), nn.Conv2d(2, 2, 3, stride=2, padding=1),
                                  nn.Conv2d(2, 2, 4, padding=2), nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")])
def test_convolutions_that_are_not_same_padded_are_refused(conv):
    with pytest.raises(UnsupportedVAE, match="a convolution with kernel"):
        Conv(conv)
