"""What every attention module shares: the selection names, the calling convention's type, the dtypes,
the memory budget of the chunked backends, and the tolerances against ``naive``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AttentionFn = Callable[..., torch.Tensor]

AUTO = "auto"
LOW_MEMORY = "low_memory"
SELECTIONS = (AUTO, LOW_MEMORY)
ON_UNAVAILABLE = ("fallback", "error")
FALLBACK_ORDER = ("sdpa", "sub_quadratic", "naive")
SDPA_FUSED = "sdpa_fused"
ANY_DEVICE = "*"

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

# 32 MiB keeps sliced and sub_quadratic more than 20x below naive's peak at 4096 tokens x 8 heads
# (fp32: about 42 and 35 MiB against 1 GiB, output included); a GPU can afford more for speed.
DEFAULT_MEMORY_BUDGET_BYTES = 32 * 2**20
# Score-sized buffers per slice or chunk: ``sliced`` holds the scores and their softmax,
# ``sub_quadratic`` the scores and, with a boolean mask, its additive form. The budget is divided by this.
SCORE_COPIES = 2


@dataclass(frozen=True)
class Tolerance:
    """``|out - naive| <= atol + rtol * |naive|`` elementwise, as in ``torch.allclose``."""

    atol: float
    rtol: float

    def describe(self) -> str:
        return f"atol {self.atol:g} + rtol {self.rtol:g}"


TOLERANCE_FP32 = Tolerance(atol=1e-4, rtol=1e-4)
TOLERANCE_FP16 = Tolerance(atol=5e-3, rtol=5e-3)
TOLERANCE_BF16 = Tolerance(atol=3e-2, rtol=3e-2)
TOLERANCES = {torch.float32: TOLERANCE_FP32, torch.float16: TOLERANCE_FP16, torch.bfloat16: TOLERANCE_BF16}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the exact backends compute in: fp32 for half inputs."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without its prefix (``float16``), as the reasons and signatures write it."""
    return str(dtype).removeprefix("torch.")
