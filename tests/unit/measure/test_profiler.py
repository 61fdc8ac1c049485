"""Profiler core on CPU: step bookkeeping, peak RSS with reset, optimization notes."""
import pytest
import torch

from sdopt.optim import profiler
from sdopt.optim.profiler import MEMORY_RAM, PeakMemory, SamplingRun, note_optimization, steady_it_per_s

MIB = 1024 * 1024


def _busy(n=200_000):
    return sum(i * i for i in range(n))


def _run(steps: int, label="r", optimizations=()):
    run = SamplingRun(label, "cpu", optimizations)
    with run.memory_scope():
        run.start()
        for _ in range(steps):
            _busy()
            run.step()
        _busy()
        run.finish()
    return run


def test_steps_first_step_and_total():
    result = _run(4).result()
    seconds = [s["seconds"] for s in result.steps]
    assert [s["index"] for s in result.steps] == [0, 1, 2, 3]
    assert all(s > 0 for s in seconds)
    assert result.first_step_s == seconds[0]
    assert result.sampler_total_s > sum(seconds), "the tail after the last step belongs to the total only"
    assert result.steady_it_per_s == pytest.approx(3 / sum(seconds[1:]))
    assert result.memory_kind == MEMORY_RAM


def test_steady_rate_with_one_step_uses_that_step():
    assert steady_it_per_s([0.5]) == 2.0
    assert steady_it_per_s([]) == 0.0
    assert steady_it_per_s([9.0, 0.25, 0.25]) == 4.0


def test_result_before_finish_raises():
    run = SamplingRun("r", "cpu")
    run.start()
    with pytest.raises(RuntimeError, match="has not finished"):
        run.result()


@pytest.mark.skipif(not profiler._PROC_CLEAR_REFS.exists(), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_sees_an_allocation_and_resets():
    memory = PeakMemory("cpu")
    memory.reset()
    if memory.read().note:
        pytest.skip("this kernel refuses to reset VmHWM")
    baseline = memory.read().peak_bytes
    block = torch.ones(256 * MIB // 4)  # ones() touches every page, so RSS really grows
    peak = memory.read().peak_bytes
    del block
    memory.reset()
    after_reset = memory.read().peak_bytes
    assert peak - baseline >= 200 * MIB
    assert peak - after_reset >= 200 * MIB, "reset must drop the high-water mark back to the current RSS"


def test_notes_reach_only_the_active_run():
    note_optimization("SDOptAttention", "auto", "ignored")  # no run active: a no-op
    seed = [{"node": "SDOptAttention", "requested": "auto", "active": "pending", "note": ""}]
    run = SamplingRun("r", "cpu", seed)
    with run.memory_scope():
        assert profiler.active_run() is run
        note_optimization("SDOptAttention", "auto", "sdpa", "picked by timing")
        note_optimization("SDOptPrecision", "weight=fp16", "weight=fp16")
        run.start()
        run.finish()
    assert profiler.active_run() is None
    assert run.result().optimizations == [
        {"node": "SDOptAttention", "requested": "auto", "active": "sdpa", "note": "picked by timing"},
        {"node": "SDOptPrecision", "requested": "weight=fp16", "active": "weight=fp16", "note": ""},
    ]
    assert seed[0]["active"] == "pending", "the records the run was seeded with stay untouched"
