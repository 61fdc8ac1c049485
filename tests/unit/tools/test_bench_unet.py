"""bench unet without ComfyUI: its input errors come before ComfyUI boots, and the table shows the
low-memory row's budget and every row's working peak. The host tier runs the bench in ComfyUI."""
import sys

import pytest

from sdopt.tools.bench_unet import UNetBenchRow, unet_table
from sdopt.tools.cli import main

MiB = 2**20


def _row(weight_dtype="fp32", low_memory_mb=0, working=None, ratio=None, error=0.0):
    return UNetBenchRow(model="sdopt-mini-sdxl", weight_dtype=weight_dtype, active="weight=fp32, compute=fp32", resolution=2048,
                        batch=2, device="cpu", first_s=2.0, median_s=1.0, peak_memory_bytes=4096 * MiB, memory_kind="ram_rss",
                        rel_error_vs_fp32=error, latency_vs_fp32=1.0, working_peak_bytes=working, working_peak_vs_fp32=ratio,
                        low_memory_mb=low_memory_mb)


def test_negative_low_memory_budget_is_refused_before_comfyui_boots(capsys, tmp_path):
    assert main(["bench", "unet", "--comfyui", str(tmp_path), "--low-memory", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--low-memory must be a budget in MiB" in err and err.count("\n") == 1
    assert "comfy" not in sys.modules


@pytest.mark.parametrize("resolution", ["0", "-64", "72"])
def test_a_resolution_short_of_a_positive_multiple_of_64_is_refused_before_comfyui_boots(capsys, tmp_path, resolution):
    assert main(["bench", "unet", "--comfyui", str(tmp_path), "--resolution", resolution]) == 2
    err = capsys.readouterr().err
    assert f"--resolution must be a positive multiple of 64, not {resolution}" in err and err.count("\n") == 1
    assert "comfy" not in sys.modules


def test_table_shows_the_budget_and_the_working_peaks():
    rows = [_row(working=3000 * MiB, ratio=1.0), _row(low_memory_mb=256, working=600 * MiB, ratio=0.2, error=2e-6),
            _row("bf16")]
    lines = unet_table(rows).splitlines()
    assert "| working peak MiB | working peak vs fp32 |" in lines[0]
    assert "| sdopt-mini-sdxl | fp32 | — |" in lines[2] and "| 3,000.0 | 1.00 | 0.0e+00 |" in lines[2]
    assert "| sdopt-mini-sdxl | fp32 | 256 MiB |" in lines[3] and "| 600.0 | 0.20 | 2.0e-06 |" in lines[3]
    assert lines[4].endswith("| - | - | 0.0e+00 |"), "no working peak where it could not be read"


def test_table_names_the_memory_management_its_rows_ran_under():
    import dataclasses

    assert "memory management" not in unet_table([_row()]), "a ComfyUI without dynamic VRAM: nothing to name"
    table = unet_table([dataclasses.replace(_row(), memory_mode="dynamic VRAM")])
    assert table.endswith("\n\nComfyUI's memory management: dynamic VRAM (--memory-mode).")
