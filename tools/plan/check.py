"""``python -m sdopt plan --check``: the planner's predictions against real runs, each stage in a fresh
process (``real_stage``, which says what is measured), the median of several against the prediction."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...errors import UserError
from ...measure.report import markdown_table
from ..fresh_process import run_in_fresh_process
from ..progress import progress_bar
from .models import architecture
from .planner import Planner
from ...measure.memory_model import PLANNER_TOLERANCE
from .settings import MIB, SETTINGS, TEXT_ENCODE, UNET_STEP, VAE_DECODE, VAE_ENCODE

_PROC_STATUS = Path("/proc/self/status")
# The planner's accuracy target (issues 9 and 16): within 20% of the measured peak RSS growth on CPU for these.
CHECK_CASES = (("mini", UNET_STEP, 512), ("mini", UNET_STEP, 1024),
               ("full", VAE_DECODE, 512), ("full", VAE_DECODE, 1024), ("full", VAE_DECODE, 2048),
               ("sdxl-mini", UNET_STEP, 512), ("sdxl-mini", UNET_STEP, 1024), ("sdxl-mini", UNET_STEP, 2048),
               # The diffusion transformers, every stage (their VAE is one 16-channel AutoencoderKL).
               *((dit, stage, size) for dit in ("sd35-mini", "flux-mini")
                 for stage, size in ((TEXT_ENCODE, 512), (UNET_STEP, 512), (UNET_STEP, 1024), (VAE_DECODE, 512),
                                     (VAE_ENCODE, 512))))
# The module that measures a stage, run as a fresh process (``python -m``): not imported here, so that
# running it never finds it imported already by its package.
_REAL_STAGE = f"{__package__}.real_stage"


def measure_stage(model: str, stage: str, width: int, height: int, dtype: str = "fp32", device: str = "cpu",
                  cap_bytes: int | None = None) -> int | None:
    """Working-memory growth in bytes of one real run of ``stage`` with stock settings in a fresh
    process: peak RSS on a CPU (Linux only), torch's peak allocated memory on a GPU, there within
    ``cap_bytes`` of working memory where given (None: out of memory within it)."""
    return measure_stage_details(model, stage, width, height, dtype, device, cap_bytes)["measured_bytes"]


def measure_stage_details(model: str, stage: str, width: int, height: int, dtype: str = "fp32", device: str = "cpu",
                          cap_bytes: int | None = None) -> dict:
    """``measure_stage``'s figure as ``measured_bytes``; on a GPU also ``tensor_peak_bytes`` and
    ``tensor_peak_op``: the peak of the run's own tensors, counted as the planner counts them."""
    if device == "cpu" and not _PROC_STATUS.exists():
        raise UserError("measuring on a CPU reads /proc/self/status: it needs Linux")
    spec = {"model": architecture(model), "stage": stage, "width": width, "height": height, "dtype": dtype, "device": device,
            "cap_bytes": cap_bytes}
    return run_in_fresh_process(_REAL_STAGE, spec, f"measuring {stage} at {width}x{height}")


@dataclass(frozen=True)
class CheckRow:
    """One stage at one size: the prediction against the median of ``measured_bytes`` (fresh
    processes); a None there ran out of memory within ``cap_bytes`` (the GPU check's cap)."""

    model: str
    stage: str
    size: int
    predicted_bytes: int
    measured_bytes: list[int | None]
    cap_bytes: int | None = None
    tensor_peaks: list[tuple[int, str]] = field(default_factory=list)  # on a GPU: (bytes, op) of each run's tensors

    @property
    def fits(self) -> bool:
        return None not in self.measured_bytes

    @property
    def median_bytes(self) -> float:
        return statistics.median(self.measured_bytes) if self.fits else math.nan

    @property
    def error(self) -> float:
        """Predicted over measured, less 1; nan where a run did not fit the cap."""
        return self.predicted_bytes / self.median_bytes - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "median_bytes": self.median_bytes, "error": self.error}


def check_predictions(cases=CHECK_CASES, repeats: int = 3, dtype: str = "fp32", workspace: str = "cpu") -> list[CheckRow]:
    """Each case's stock-setting prediction against ``repeats`` measurements, each in a fresh process:
    on the GPU for the ``cuda`` workspace model, else on the CPU."""
    device = "cuda" if workspace == "cuda" else "cpu"
    planners: dict[str, Planner] = {}
    rows = []
    for model, stage, size in progress_bar(cases, desc=f"plan --check ({device}, {dtype})", unit="case"):
        if model not in planners:
            planners[model] = Planner(model, dtype, workspace)
        planner = planners[model]
        predicted = planner.predict(stage, SETTINGS[stage][0], size, size).peak_bytes
        cap = int(predicted * (1 + PLANNER_TOLERANCE)) if device == "cuda" else None
        runs = [measure_stage_details(model, stage, size, size, dtype, device, cap) for _ in range(repeats)]
        tensor_peaks = [(run["tensor_peak_bytes"], run["tensor_peak_op"]) for run in runs if "tensor_peak_bytes" in run]
        rows.append(CheckRow(model, stage, size, predicted, [run["measured_bytes"] for run in runs], cap, tensor_peaks))
    return rows


def check_table(rows: list[CheckRow]) -> str:
    mib = lambda b: "out of memory" if b is None else f"{b / MIB:,.0f}"
    body = [[f"{r.model} {r.stage}", f"{r.size}x{r.size}", mib(r.predicted_bytes), mib(r.median_bytes) if r.fits else "—",
             " / ".join(mib(b) for b in r.measured_bytes),
             f"{r.error:+.1%}" if r.fits else f"needs more than {mib(r.cap_bytes)} (the prediction + {PLANNER_TOLERANCE:.0%})"]
            for r in rows]
    headers = ["case", "size", "predicted MiB", "measured MiB (median)", "each run MiB", "error"]
    if any(r.tensor_peaks for r in rows):
        headers.append("the run's tensors' peak MiB (counted as the planner counts)")
        for r, line in zip(rows, body):
            line.append(" / ".join(f"{mib(b)} at {op}" for b, op in r.tensor_peaks) or "—")
    return "\n".join(markdown_table(headers, body, right={2, 3, 5}))

