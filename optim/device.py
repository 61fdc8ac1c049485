"""What the device offers: free memory, the bytes a call may still allocate on a GPU or on the host."""
from __future__ import annotations

from pathlib import Path

import torch

_PROC_MEMINFO = Path("/proc/meminfo")


def free_memory(device: torch.device | str) -> int:
    """Bytes that ``device`` can still allocate: free VRAM plus PyTorch's unused cache on CUDA, within
    the process's memory fraction (``torch.cuda.set_per_process_memory_fraction``) where one is set;
    MemAvailable (or psutil's available) for host memory."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:  # torch's get_per_process_memory_fraction takes no bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        usable = free + torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            usable = min(usable, int(fraction(device) * total) - allocated)
        return max(usable, 0)
    if _PROC_MEMINFO.exists():
        for line in _PROC_MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        import psutil
    except ImportError:
        raise RuntimeError("cannot read the free host memory (no /proc/meminfo, no psutil): pass a budget") from None
    return psutil.virtual_memory().available
