"""bench speed's image check: the difference of two images in levels of 0–255, and the tolerance
a traced, compiled or graphed rung's image must keep to its eager twin's."""
import pytest
import torch

from sdopt.tools.bench_speed import IMAGE_TOLERANCE, ImageTolerance, pixel_difference


def test_difference_is_in_levels_of_255():
    reference = torch.full((1, 8, 8, 3), 0.5)
    image = reference.clone()
    image[0, 0, 0, 0] += 4 / 255
    image[0, 1, 1, 1] -= 2 / 255
    largest, mean = pixel_difference(image, reference)
    assert largest == pytest.approx(4, abs=1e-4)
    assert mean == pytest.approx(6 / image.numel(), abs=1e-6)


def test_tolerance_bounds_the_largest_and_the_mean_difference():
    tolerance = ImageTolerance(max_levels=16, mean_levels=2)
    assert tolerance.admits(16, 2)
    assert not tolerance.admits(16.5, 0.1), "one pixel far off is out"
    assert not tolerance.admits(3, 2.5), "a small shift everywhere is out too"


def test_a_stale_weight_image_is_out_of_the_shipped_tolerance():
    generator = torch.Generator().manual_seed(0)
    eager = torch.rand(1, 64, 64, 3, generator=generator)
    stale = torch.rand(1, 64, 64, 3, generator=generator)
    assert not IMAGE_TOLERANCE.admits(*pixel_difference(stale, eager))
    assert IMAGE_TOLERANCE.admits(*pixel_difference((eager + 1 / 255).clamp(0, 1), eager))
