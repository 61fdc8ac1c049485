"""The tiled VAE's settings: each problem named under its own input, and what the stats say."""
import pytest

from sdopt.errors import UserError
from sdopt.optim.tiled_vae import TiledVAEConfig, TilingStats, check_overlap, check_tile, check_tile_inputs


@pytest.mark.parametrize(("tile", "overlap", "input_name"), [
    (100, 0, "tile: 100 px is not a multiple of 8"),
    (32, 0, "tile: 32 px is under the 64 px minimum"),
    (512, 512, "overlap: 512 px must be smaller than tile"),
    (512, 12, "overlap: 12 px must be 0 or a positive multiple of 8"),
])
def test_invalid_settings_name_the_input(tile, overlap, input_name):
    assert check_tile_inputs(tile, overlap).startswith(input_name)
    with pytest.raises(UserError, match=f"^{input_name}"):
        TiledVAEConfig(tile=tile, overlap=overlap)


def test_each_check_reports_only_its_own_input():
    assert check_tile(100).startswith("tile: ") and check_tile(0) is None and check_tile(None) is None
    assert check_overlap(12, None).startswith("overlap: ") and check_overlap(64, 0) is None
    assert check_overlap(64, 64).startswith("overlap: 64 px must be smaller than tile (64 px)")
    assert check_tile(64) is None and check_overlap(56, 64) is None


def test_valid_settings_pass():
    assert check_tile_inputs(None, 0) is None and check_tile_inputs(0, 64) is None
    assert check_tile_inputs(64, 56) is None
    with pytest.raises(UserError, match="^budget_bytes"):
        TiledVAEConfig(budget_bytes=0)
    with pytest.raises(UserError, match="^min_tile"):
        TiledVAEConfig(min_tile=72 - 4)


def test_stats_describe_the_call():
    stats = TilingStats(True, tile=512, grid=(2, 3), passes=31, kept_intermediates=False, oom_retries=1,
                        tiles_tried=(1024, 512), store_dtype="fp16", stored=600, stored_wide=40, compute_dtype="fp32")
    assert stats.tiles == 6
    assert stats.describe() == ("tiled 512 px, 2x3 = 6 tiles, 31 passes, recomputed intermediates, 1 OOM retries "
                                "(tile 1024 → 512 px), 40 of 600 stored tile values past fp16's range kept in fp32")
    assert TilingStats(False, reason="fits").describe() == "untiled (fits)"
