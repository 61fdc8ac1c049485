"""The attention bench: row fields, JSON round trip, the table, and the chunked backends' peak memory."""
import json

import pytest
import torch

from sdopt.errors import UserError
from sdopt.measure import profiler
from sdopt.optim.attention import backend_function
from sdopt.tools.bench_attention import (
    STATUS_OK,
    STATUS_UNAVAILABLE,
    AttentionBenchRow,
    attention_table,
    bench_attention,
    peak_memory_delta,
)

# The memory claim: at 4096 tokens x 8 heads (head dim 64, fp32) the chunked backends peak at
# least this many times below naive, which holds two 512 MiB score matrices.
MEMORY_RATIO = 8


@pytest.fixture(scope="module")
def rows():
    return bench_attention([128, 77], heads=2, head_dim=40, backends=["sdpa", "sub_quadratic", "naive", "xformers"], repeats=1, progress=False)


def test_rows_have_sane_fields(rows):
    assert [(r.backend, r.tokens) for r in rows] == [
        (name, tokens) for tokens in (128, 77) for name in ("sdpa", "sub_quadratic", "naive", "xformers")
    ]
    for row in rows:
        assert (row.heads, row.head_dim, row.dtype, row.device) == (2, 40, "fp32", "cpu")
        if row.backend == "xformers":
            assert row.status == STATUS_UNAVAILABLE and "xformers" in row.reason
            assert row.mean_s is None and row.peak_memory_bytes is None and row.max_abs_error is None
            continue
        assert row.status == STATUS_OK
        assert row.mean_s > 0
        assert row.peak_memory_bytes >= 0 and row.memory_kind == profiler.MEMORY_RAM
        assert row.max_abs_error <= 1e-4
    assert next(r for r in rows if r.backend == "naive").max_abs_error == 0.0


def test_rows_round_trip_through_json(rows):
    text = json.dumps([row.to_dict() for row in rows])
    assert [AttentionBenchRow(**data) for data in json.loads(text)] == rows


def test_table_has_a_line_per_row(rows):
    table = attention_table(rows).splitlines()
    assert table[0].startswith("| backend | tokens |")
    assert len(table) == 2 + len(rows)
    naive = next(line for line in table if line.startswith("| naive | 128 |"))
    assert "| 1.0x |" in naive or "| — |" in naive  # the naive peak can read as 0 at this size
    assert "pip install xformers" in table[-1]


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="dtype"):
        bench_attention([8], dtype="fp8", progress=False)
    with pytest.raises(UserError, match="unknown attention backend"):
        bench_attention([8], backends=["nope"], progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="torch sees no CUDA device here .*; give --device cpu$"):
            bench_attention([8], device="cuda", progress=False)


@pytest.mark.skipif(not profiler._PROC_CLEAR_REFS.exists(), reason="needs Linux /proc/self/clear_refs to reset peak RSS")
def test_chunked_backends_peak_far_below_naive():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 64, generator=generator) for _ in range(3))
    peaks = {}
    for name in ("naive", "sliced", "sub_quadratic"):
        # No warm-up call (the bench makes one): one-time allocations can only raise a peak here.
        peak, kind, note = peak_memory_delta(backend_function(name), q, k, v)
        if note:
            pytest.skip(note)
        peaks[name] = peak
    # the 512 MiB score matrix and most of its softmax (RSS can miss a few pages under memory pressure)
    assert peaks["naive"] >= 1.5 * 512 * 2**20, "naive holds the scores and their softmax"
    for name in ("sliced", "sub_quadratic"):
        assert peaks[name] * MEMORY_RATIO <= peaks["naive"], f"{name}: {peaks}"
