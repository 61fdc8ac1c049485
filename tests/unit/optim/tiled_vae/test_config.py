"""The tiled VAE's settings: each problem named under its own input, and what the stats say."""
import pytest
import torch

from sdopt.errors import UserError
from sdopt.optim.tiled_vae import TiledVAEConfig, TilingStats, check_overlap, check_tile, check_tile_inputs, free_memory


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


def _fake_cuda(monkeypatch, free, total, reserved, allocated, fraction=None):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    if fraction is None:
        monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    else:
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: _indexed(device, fraction), raising=False)


def _indexed(device, answer):
    """``answer``, where ``device`` names a GPU by its index, as torch's strict device functions need."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.index is None:
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    return answer


def test_free_vram_counts_pytorchs_unused_cache(monkeypatch):
    _fake_cuda(monkeypatch, free=10 << 30, total=80 << 30, reserved=3 << 30, allocated=1 << 30)
    assert free_memory("cuda:0") == 12 << 30


def test_free_vram_stays_within_the_process_memory_fraction(monkeypatch):
    # a process capped at 1/10 of an 80 GiB card (as bench --vram-cap sets it) may hold 8 GiB in all,
    # whatever the card has free
    _fake_cuda(monkeypatch, free=70 << 30, total=80 << 30, reserved=3 << 30, allocated=2 << 30, fraction=0.1)
    assert free_memory("cuda:0") == int(0.1 * (80 << 30)) - (2 << 30)
    _fake_cuda(monkeypatch, free=70 << 30, total=80 << 30, reserved=9 << 30, allocated=9 << 30, fraction=0.1)
    assert free_memory("cuda:0") == 0


def test_free_vram_of_a_bare_cuda_device_reads_the_current_gpu(monkeypatch):
    # the planner's GPU check and doctor ask for "cuda" with no index (torch 2.11 raised on it: H200 lease, 2026-11-28)
    _fake_cuda(monkeypatch, free=70 << 30, total=80 << 30, reserved=3 << 30, allocated=2 << 30, fraction=0.1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert free_memory("cuda") == free_memory("cuda:0") == int(0.1 * (80 << 30)) - (2 << 30)
