"""UNet precision bench on the tiny UNet: rows, the fp32 reference, errors, and the CLI's JSON."""
import json

import pytest

from sdopt.cli import main
from sdopt.errors import UserError
from sdopt.optim.bench_unet import bench_unet

BF16_REL_ERROR = 5e-2


def test_rows_put_fp32_first_as_the_reference():
    rows = bench_unet("tiny", ["bf16"], resolution=64, batch=2, device="cpu", repeats=1, progress=False)
    assert [r.dtype for r in rows] == ["fp32", "bf16"]
    fp32, bf16 = rows
    assert fp32.rel_error_vs_fp32 == 0.0 and fp32.latency_vs_fp32 == 1.0
    assert 0 < bf16.rel_error_vs_fp32 < BF16_REL_ERROR, "bf16 must differ from fp32, a little"
    assert all(r.mean_s > 0 and r.first_s > 0 and r.peak_memory_bytes > 0 for r in rows)


def test_bad_resolution_is_a_user_error():
    with pytest.raises(UserError, match="--resolution must be a multiple of 16"):
        bench_unet("tiny", ["fp32"], resolution=72, device="cpu", repeats=1, progress=False)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "unet.json"
    argv = ["bench", "unet", "--size", "tiny", "--resolution", "64", "--dtypes", "fp32", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    assert row["size"] == "tiny" and row["dtype"] == "fp32" and row["memory_kind"] == "ram_rss"
    assert "| tiny | fp32 | 64 | 2 | cpu |" in capsys.readouterr().out
