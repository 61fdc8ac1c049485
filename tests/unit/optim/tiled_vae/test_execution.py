"""Whole-image GroupNorm statistics from per-tile sums, the tile grid, and the wide store."""
import torch

from sdopt.optim.tiled_vae.execution import Grid, group_stats, merge_stats


def test_merged_tile_statistics_equal_the_whole_images():
    """Chan's merge of per-tile (count, mean, M2) gives the whole image's per-group mean and
    variance, also where the mean dominates the spread (the cancellation-prone case)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 24, 30, generator=g) * 0.01 + torch.tensor([0.0, 300.0]).view(2, 1, 1, 1)
    grid = Grid(24, 30, 10)
    acc = None
    for t in range(len(grid)):
        y0, y1, x0, x1 = grid.core(t, 1)
        acc = merge_stats(acc, *group_stats(x[:, :, y0:y1, x0:x1], 4))
    n, mean, m2 = acc
    var_ref, mean_ref = torch.var_mean(x.double().unflatten(1, (4, -1)), dim=(2, 3, 4), correction=0)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(m2 / n, var_ref, rtol=1e-4, atol=0)


def test_the_grid_splits_evenly_and_covers_every_pixel_once():
    grid = Grid(13, 18, 8)
    assert grid.shape == (2, 3) and grid.rows == [0, 6, 13] and grid.cols == [0, 6, 12, 18]
    covered = torch.zeros(13, 18, dtype=torch.int32)
    for t in range(len(grid)):
        y0, y1, x0, x1 = grid.core(t, 1)
        covered[y0:y1, x0:x1] += 1
    assert bool((covered == 1).all())
    assert grid.tiles_in((5, 7, 11, 13), 1) == [1, 2, 4, 5]
    assert grid.core(5, 8) == (48, 104, 96, 144)
