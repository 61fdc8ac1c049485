"""``trim_heap`` hands the C heap's free pages back to the OS."""
import ctypes.util

import psutil
import pytest

from sdopt.optim.heap_trim import _malloc_trim, trim_heap

GLIBC = _malloc_trim() is not None


@pytest.mark.skipif(not GLIBC, reason=f"no malloc_trim in this C library ({ctypes.util.find_library('c')})")
def test_freed_heap_blocks_leave_the_resident_set():
    """Blocks under glibc's mmap threshold come from the heap; freed below a block still alive, they
    stay resident until trimmed."""
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB, written, so resident
    keeper = bytearray(64 * 1024)  # above them: the heap's top cannot shrink on its own
    del blocks
    trim_heap()
    before = psutil.Process().memory_info().rss
    blocks = [bytearray(64 * 1024) for _ in range(3200)]
    del blocks
    freed_but_resident = psutil.Process().memory_info().rss - before
    assert trim_heap()
    returned = before + freed_but_resident - psutil.Process().memory_info().rss
    assert freed_but_resident > 150 * 2**20, "the freed blocks stayed resident before the trim"
    assert returned > 150 * 2**20, f"trim_heap gave back {returned / 2**20:.0f} MiB of 200"
    del keeper


@pytest.mark.skipif(GLIBC, reason="this C library has malloc_trim")
def test_says_when_it_cannot():
    assert trim_heap() is False
