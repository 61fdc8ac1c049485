"""Profiler core on CPU: step bookkeeping, peak RSS with reset, records filed in the active run."""
import pytest
import torch

from sdopt.measure import profiler
from sdopt.measure.profiler import MEMORY_LABELS, MEMORY_RAM, MEMORY_VRAM, PeakMemory, SamplingRun, format_mib, steady_it_per_s, steady_steps
from sdopt.measure.record import record

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
    assert result.steady_steps == [1, 2, 3] and all(s["warmup"] == {} for s in result.steps)
    assert result.memory_kind == MEMORY_RAM


def test_steady_rate_with_one_step_uses_that_step():
    assert steady_it_per_s([0.5]) == 2.0
    assert steady_it_per_s([]) is None, "no step: no rate"
    assert steady_it_per_s([9.0, 0.25, 0.25]) == 4.0


def test_steady_rate_leaves_out_warm_up_steps():
    assert steady_it_per_s([0.5, 40.0, 0.25, 0.25], warmup={1}) == 4.0
    assert steady_steps(4, {1}) == [2, 3]
    assert steady_it_per_s([0.5, 40.0], warmup={1}) == 2.0 and steady_steps(2, {1}) == [0], (
        "no later step free of warm-up: the first step, which the report flags"
    )
    assert steady_it_per_s([30.0, 0.2, 0.2], warmup={0}) == 5.0 and steady_steps(3, {0}) == [1, 2]
    assert steady_it_per_s([30.0], warmup={0}) is None and steady_steps(1, {0}) == [], "every step warm-up: no rate"


def test_a_step_marked_warm_up_stays_in_the_steps_and_out_of_the_steady_rate():
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        run.start()
        for index in range(4):
            if index == 1:
                run.warm_up("compile", 2.5)
                run.warm_up("compile", 0.5)
                run.warm_up("capture", 0.25)
            _busy()
            run.step()
        run.warm_up("compile", 9.0)  # after the last step: in the total only
        run.finish()
    result = run.result()
    seconds = [s["seconds"] for s in result.steps]
    assert [s["warmup"] for s in result.steps] == [{}, {"compile": 3.0, "capture": 0.25}, {}, {}]
    assert result.steady_steps == [2, 3]
    assert result.steady_it_per_s == pytest.approx(2 / (seconds[2] + seconds[3]))
    assert result.first_step_s == seconds[0]


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


@pytest.mark.skipif(not profiler._PROC_CLEAR_REFS.exists(), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_growth_counts_what_the_function_touches_and_not_what_came_before():
    before = torch.ones(256 * MIB // 4)  # the high-water mark from this block must not count
    del before
    result, peak, growth = profiler.peak_rss_growth(lambda: float(torch.ones(128 * MIB // 4).sum()))
    assert result == 128 * MIB // 4
    assert 100 * MIB <= growth < 200 * MIB
    assert peak >= growth


def test_allocated_growth_is_the_peak_held_above_the_start_not_what_came_before():
    before = torch.ones(64 * MIB // 4)

    def work():
        a = torch.ones(8 * MIB // 4)
        b = a + 1  # 16 MiB held here
        del a
        c = b * 2  # 16 MiB again
        return float(c[0])

    result, peak = profiler.allocated_growth("cpu", work)
    assert result == 4.0
    assert peak == pytest.approx(16 * MIB, abs=64 * 1024)
    del before


def test_allocated_growth_runs_the_call_unmeasured_inside_another_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
        result, peak = profiler.allocated_growth("cpu", lambda: float(torch.ones(4).sum()))
    assert (result, peak) == (4.0, None)
    assert any(event.key == "aten::ones" for event in outer.key_averages()), "the outer profile was spoilt"


def test_records_filed_in_a_run_replace_per_node_and_leave_the_seed():
    seed = [{"node": "SDOptAttention", "requested": "auto", "active": "pending", "note": ""}]
    run = SamplingRun("r", "cpu", seed)
    assert profiler.active_run() is None
    with run.memory_scope():
        active = profiler.active_run()
        assert active is run
        record(active.optimizations, "SDOptAttention", "auto", "sdpa", "picked by timing")
        record(active.optimizations, "SDOptPrecision", "weight=fp16", "weight=fp16")
        record(active.optimizations, "SDOptAttention", "auto", "sliced", "second decision")
        run.start()
        run.finish()
    assert profiler.active_run() is None
    assert run.result().optimizations == [
        {"node": "SDOptPrecision", "requested": "weight=fp16", "active": "weight=fp16", "note": "", "short": ""},
        {"node": "SDOptAttention", "requested": "auto", "active": "sliced", "note": "second decision", "short": ""},
    ], "one record per node: the later record of a node replaces the earlier one"
    assert seed == [{"node": "SDOptAttention", "requested": "auto", "active": "pending", "note": ""}], (
        "the records the run was seeded with stay untouched"
    )


def test_result_records_are_copies():
    run = _run(1, optimizations=[{"node": "N", "requested": "a", "active": "b", "note": ""}])
    first = run.result().optimizations
    first[0]["active"] = "changed"
    assert run.result().optimizations[0]["active"] == "b"


def test_memory_scope_restores_the_outer_run():
    outer, inner = SamplingRun("outer", "cpu"), SamplingRun("inner", "cpu")
    with outer.memory_scope():
        with inner.memory_scope():
            assert profiler.active_run() is inner
        assert profiler.active_run() is outer
    assert profiler.active_run() is None


def test_format_mib_and_labels():
    assert format_mib(None) == "-"
    assert format_mib(0) == "0.0"
    assert format_mib(1536 * MIB) == "1,536.0"
    assert format_mib(MIB // 2) == "0.5"
    assert MEMORY_LABELS == {MEMORY_VRAM: "VRAM", MEMORY_RAM: "RAM"}
    assert PeakMemory("cpu").kind == MEMORY_RAM and PeakMemory("cuda:0").kind == MEMORY_VRAM


def test_memory_outside_the_allocator_peaks_over_start_steps_and_end():
    usage = iter([100, 700, 300, 200])  # reset, step 1, step 2, read
    run = SamplingRun("dynamic", "cpu", outside_allocator=lambda: next(usage))
    with run.memory_scope():
        run.start()
        run.step()
        run.step()
        run.finish()
    result = run.result()
    assert result.peak_outside_allocator_bytes == 700
    assert SamplingRun("plain", "cpu").memory.read().outside_allocator_bytes is None
