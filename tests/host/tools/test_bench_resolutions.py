"""bench resolutions inside ComfyUI, on the mini checkpoint at 64 and 128 px with 2 steps on a CPU:
every cell fits, so every stack runs at both sizes (sdopt Auto with goal fit: Low Memory, eager), and
sdopt's and Auto's images equal stock's. The UNet stacks are exact up to float rounding and the tiled
VAE holds ≥ 40 dB PSNR, so 40 dB is the bound."""
import json
import math

import pytest

from sdopt.tools.cli import main

MIN_PSNR_DB = 40.0


@pytest.fixture(scope="module")
def bench(comfy_host, tmp_path_factory):
    folder = tmp_path_factory.mktemp("resolutions")
    out, plot = folder / "resolutions.json", folder / "resolutions.png"
    argv = ["bench", "resolutions", "--comfyui", str(comfy_host.host.path), "--model", str(comfy_host.checkpoint),
            "--sizes", "64,128", "--steps", "2", "--json", str(out), "--plot", str(plot), "--auto-goal", "fit"]
    assert main(argv) == 0
    return json.loads(out.read_text()), plot


def test_every_stack_ran_at_every_size(bench):
    rows, _ = bench
    assert [(r["size"], r["stack"], r["status"]) for r in rows] == [
        (size, stack, "ok") for size in (64, 128) for stack in ("stock", "sdopt", "auto")]
    for row in rows:
        assert row["seconds"] == pytest.approx(row["sampler_s"] + row["decode_s"]) and row["decode_s"] > 0
        assert 0 < row["predicted_peak_bytes"] <= row["budget_bytes"] and row["peak_memory_bytes"] > 0
        assert row["steps"] == 2 and row["model"] == "sdopt-mini-sd15"


def test_sdopt_and_auto_images_equal_stock(bench):
    rows, _ = bench
    for row in rows:
        if row["stack"] != "stock":
            assert row["psnr_vs_stock_db"] >= MIN_PSNR_DB, row
        else:
            assert row["psnr_vs_stock_db"] is None


def test_sdopt_rows_say_what_each_node_did(bench):
    rows, _ = bench
    notes = [r["notes"] for r in rows if r["stack"] == "sdopt"]
    for note in notes:
        assert "SDOptLowMemory: budget 256 MiB" in note and "SDOptTiledVAE: decode" in note
        assert "SDOptOffload: no-op" in note, "on a CPU the offload node passes the model through"


def test_auto_rows_say_what_auto_chose_at_each_size(bench):
    rows, _ = bench
    for row in (r for r in rows if r["stack"] == "auto"):
        assert row["auto_goal"] == "fit"
        assert "SDOptAuto" in row["notes"] and "Low Memory(64 MiB)" in row["notes"], row["notes"]
        assert "SDOptTiledVAE: decode" in row["notes"], "Auto's VAE output decodes in tiles where needed"


def test_heatmap_written(bench):
    _, plot = bench
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_sdxl_mini_cells_run_and_the_planner_knows_the_architecture(comfy_host, sdxl_checkpoint, tmp_path):
    out = tmp_path / "resolutions.json"
    argv = ["bench", "resolutions", "--comfyui", str(comfy_host.host.path), "--model", str(sdxl_checkpoint),
            "--sizes", "64", "--steps", "1", "--json", str(out), "--against-uncapped", "--stacks", "stock", "sdopt"]
    assert main(argv) == 0
    stock, sdopt = json.loads(out.read_text())
    assert (stock["status"], sdopt["status"]) == ("ok", "ok") and stock["model"] == "sdopt-mini-sdxl"
    assert sdopt["psnr_vs_stock_db"] >= MIN_PSNR_DB
    # no cap applies on a CPU: the uncapped reference is stock run again, which must repeat itself exactly
    assert stock["psnr_vs_uncapped_db"] == math.inf and sdopt["psnr_vs_uncapped_db"] == pytest.approx(sdopt["psnr_vs_stock_db"])
    assert 0 < stock["predicted_peak_bytes"] <= stock["budget_bytes"]


def test_when_needed_with_auto_offload_the_sdopt_cell_leaves_low_memory_out_and_equals_stock_exactly(comfy_host, tmp_path):
    out = tmp_path / "resolutions.json"
    argv = ["bench", "resolutions", "--comfyui", str(comfy_host.host.path), "--model", str(comfy_host.checkpoint),
            "--sizes", "64", "--steps", "2", "--json", str(out), "--low-memory", "when-needed", "--offload-mb", "auto",
            "--stacks", "stock", "sdopt"]
    assert main(argv) == 0
    stock, sdopt = json.loads(out.read_text())
    assert sdopt["status"] == "ok" and sdopt["low_memory"] == "when-needed" and sdopt["offload_mb"] is None
    assert sdopt["predicted_settings"].startswith("sdpa, CFG batch 2;"), "64 px fits without Low Memory"
    assert "; Offload budget " in sdopt["predicted_settings"], "the free RAM leaves the whole UNet resident"
    assert "SDOptLowMemory" not in sdopt["notes"] and "SDOptOffload" in sdopt["notes"]
    assert sdopt["psnr_vs_stock_db"] == math.inf, "Offload and an untiled decode change no number"
