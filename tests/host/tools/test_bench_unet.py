"""bench unet inside ComfyUI: each row is SDOptPrecision's model for one weight dtype, fp32 first as the
reference, then optionally the fp32 model through SDOptLowMemory; on the SD1.5 and SDXL mini checkpoints."""
import json

import pytest
import torch

from sdopt.tools.bench_unet import bench_unet, unet_table
from sdopt.tools.cli import main

# Relative L2 error of one UNet call in bf16 against fp32 on the mini checkpoint.
BF16_REL_ERROR = 5e-2
# Low Memory changes the order of float sums only (sequential CFG, chunked ops, sub-quadratic attention).
LOW_MEMORY_REL_ERROR = 1e-5


@pytest.fixture(scope="module")
def rows(comfy_host):
    return bench_unet(comfy_host.host.path, str(comfy_host.checkpoint), ["auto", "bf16"], resolution=64, batch=2,
                      repeats=1, progress=False)


def test_fp32_runs_first_as_the_reference(rows):
    assert [r.weight_dtype for r in rows] == ["fp32", "auto", "bf16"]
    fp32 = rows[0]
    assert fp32.rel_error_vs_fp32 == 0.0 and fp32.latency_vs_fp32 == 1.0
    assert fp32.active.startswith("weight=fp32")
    assert all(r.median_s > 0 and r.first_s > 0 and r.peak_memory_bytes > 0 for r in rows)


def test_rows_measure_the_model_the_node_returns(rows):
    bf16 = rows[2]
    assert bf16.active.startswith("weight=bf16, compute=bf16")
    assert 0 < bf16.rel_error_vs_fp32 < BF16_REL_ERROR, "bf16 must differ from fp32, a little"
    auto = rows[1]
    # auto times a probe on a CPU, so a busy machine can tip its pick either way: check it picked a
    # dtype this device runs, not that a second probe agrees
    allowed = ("weight=fp16",) if torch.device(auto.device).type == "cuda" else ("weight=fp32", "weight=bf16")
    assert auto.active.startswith(allowed), auto.active


def test_cli_writes_json(comfy_host, tmp_path, capsys):
    out = tmp_path / "unet.json"
    argv = ["bench", "unet", "--comfyui", str(comfy_host.host.path), "--model", str(comfy_host.checkpoint),
            "--resolution", "64", "--dtypes", "fp32", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert row["weight_dtype"] == "fp32" and row["memory_kind"] in ("ram_rss", "vram_allocated")
    assert "| sdopt-mini-sd15 | fp32 | — | weight=fp32, compute=fp32 | 64 | 2 |" in capsys.readouterr().out


def test_bad_resolution_is_a_user_error(comfy_host, capsys):
    assert main(["bench", "unet", "--comfyui", str(comfy_host.host.path), "--resolution", "72"]) == 2
    assert "--resolution must be a positive multiple of 64" in capsys.readouterr().err


def test_sdxl_mini_rows_and_low_memory_equal_fp32(comfy_host, sdxl_checkpoint):
    """The SDXL UNet gets its ``y`` vector (it raises without one); Low Memory's row keeps to fp32's output."""
    rows = bench_unet(comfy_host.host.path, str(sdxl_checkpoint), ["bf16"], resolution=64, batch=2, repeats=1,
                      progress=False, low_memory_mb=1)
    assert [(r.weight_dtype, r.low_memory_mb) for r in rows] == [("fp32", 0), ("bf16", 0), ("fp32", 1)]
    fp32, bf16, low_memory = rows
    assert 0 < bf16.rel_error_vs_fp32 < BF16_REL_ERROR
    assert "budget 1 MiB" in low_memory.active and "sequential cfg" in low_memory.active
    assert low_memory.rel_error_vs_fp32 < LOW_MEMORY_REL_ERROR
    assert all(r.model == "sdopt-mini-sdxl" and r.working_peak_bytes is not None for r in rows)
    assert "| sdopt-mini-sdxl | fp32 | 1 MiB |" in unet_table(rows)
