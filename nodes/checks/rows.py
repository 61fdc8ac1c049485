"""The doctor's rows: ``CheckRow`` (what was tried, a status, the result, the fix), what the checks are
given (``Context``, with ``ComfyInfo``), the helpers they share, and the table and summary of the rows."""
from __future__ import annotations

import importlib.metadata
from dataclasses import asdict, dataclass, field

import torch

from ...measure.report import markdown_table

OK, WARN, UNAVAILABLE, FAILED = "ok", "warn", "unavailable", "failed"
STATUSES = (OK, WARN, UNAVAILABLE, FAILED)
GIB = 2**30
MIB = 2**20
TRIAL_SEED = 0


@dataclass
class CheckRow:
    """One line of the doctor's table. ``fix`` is required for every status but ``ok``."""

    check: str
    tried: str
    status: str
    result: str
    fix: str = ""
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")
        if self.status != OK and not self.fix:
            raise ValueError(f"{self.check}: a {self.status} row needs a fix")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ComfyInfo:
    """What the doctor knows of ComfyUI. ``dynamic_vram``: None where this ComfyUI has no dynamic
    VRAM, else whether it is on in this process; ``in_server``: read from a running ComfyUI (the
    node) rather than imported by the CLI."""

    path: str | None
    version: str | None = None
    missing_apis: tuple[str, ...] = ()
    dynamic_vram: bool | None = None
    in_server: bool = False
    error: str = ""


@dataclass
class Context:
    device: torch.device
    comfyui: ComfyInfo | None
    rows: dict[str, CheckRow] = field(default_factory=dict)  # by check name: node rows read the trials


# --- small helpers the checks share ---------------------------------------------------------------


def gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def seeded_generator() -> torch.Generator:
    return torch.Generator().manual_seed(TRIAL_SEED)


def randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32, generator=None) -> torch.Tensor:
    return torch.randn(*shape, generator=generator or seeded_generator()).to(device, dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__}" + (f" (CUDA {cuda})" if cuda else " (no CUDA)")


# --- the table ------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def doctor_table(rows: list[CheckRow]) -> str:
    body = [[_cell(r.check), r.status, _cell(r.result), _cell(r.fix) or "—", _cell(r.tried)] for r in rows]
    return "\n".join(markdown_table(["check", "status", "result", "fix", "tried"], body))


def summary(rows: list[CheckRow], seconds: float | None = None) -> str:
    counts = {status: sum(r.status == status for r in rows) for status in STATUSES}
    text = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    return text + (f"; took {seconds:.1f} s" if seconds is not None else "")
