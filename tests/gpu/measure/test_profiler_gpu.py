"""Profiler on CUDA: event timing and allocator peaks, reset at the start of each run."""
import torch

from sdopt.measure.profiler import MEMORY_VRAM, SamplingRun

MIB = 1024 * 1024


def _run(allocate_mib: int):
    run = SamplingRun("gpu", "cuda")
    a = torch.randn(1024, 1024, device="cuda")
    with run.memory_scope():
        run.start()
        for _ in range(3):
            block = torch.empty(allocate_mib * MIB, dtype=torch.uint8, device="cuda")
            a = a @ a.T / 1024
            del block
            run.step()
        run.finish()
    return run.result()


def test_vram_peak_is_reset_per_run_and_steps_are_timed():
    big = _run(512)
    small = _run(16)
    assert big.memory_kind == MEMORY_VRAM and big.peak_reserved_bytes >= big.peak_memory_bytes
    assert big.peak_memory_bytes - small.peak_memory_bytes >= 450 * MIB
    assert len(big.steps) == 3 and all(s["seconds"] > 0 for s in big.steps)
    assert big.sampler_total_s >= sum(s["seconds"] for s in big.steps)
