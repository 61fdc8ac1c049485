"""Freed host memory handed back to the operating system (glibc's ``malloc_trim``).

CPU tensors come from the C heap. glibc raises its mmap threshold each time a large block is freed
(up to 32 MiB on 64-bit), so after a few sampling runs activations, latents and decoded images are
carved from the heap, and the pages they free stay with the process: a ComfyUI server's RSS climbs
by hundreds of MiB over a session with no live object behind it (``docs/benchmarks-log.md``, Soak: 630
MiB of free heap after 30 prompts, stock ComfyUI included). ``malloc_trim(0)`` returns every free
page; the next run faults in what it touches again. Where the C library has no ``malloc_trim``
(macOS, Windows, musl) ``trim_heap`` does nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS; False where this C library cannot."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True
