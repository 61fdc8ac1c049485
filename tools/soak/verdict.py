"""A soak's verdict: how each prompt ended, when the server's memory is read, the drift between the warm
and the end readings, and what fails the soak."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .server import SUCCESS

DEFAULT_MAX_DRIFT = 0.05
READING_EVERY = 10  # prompts between two RSS readings after the warm-up
ENDS = 3  # readings whose median is the warm (first ones) and the end (last ones) RSS


@dataclass
class PromptOutcome:
    """How one prompt ended: ``status`` is success, error (its history says so), rejected (the server
    refused the prompt) or timeout."""

    index: int
    chain: str
    status: str
    seconds: float
    error: str = ""
    rss_bytes: int | None = None  # the server's, right after the prompt: where the memory went, prompt by prompt

    @property
    def failed(self) -> bool:
        return self.status != SUCCESS


def drift(warm_bytes: int, end_bytes: int) -> float:
    """The RSS change from the warm reading to the end one, as a fraction of the warm one."""
    if warm_bytes <= 0:
        raise ValueError(f"warm RSS must be positive, got {warm_bytes}")
    return (end_bytes - warm_bytes) / warm_bytes


def problems(outcomes: list[PromptOutcome], memory_drift: float | None, max_drift: float) -> list[str]:
    """What fails the soak, one line each; empty when it passed."""
    found = [f"prompt {o.index} {o.status}: {o.error.splitlines()[0] if o.error else ''} [{o.chain}]".replace(":  [", " [")
             for o in outcomes if o.failed]
    if memory_drift is None:
        found.append("no RSS reading: the soak stopped before the end reading")
    elif memory_drift > max_drift:
        found.append(f"RSS drift {memory_drift:+.1%} is above the {max_drift:.1%} allowed")
    return found


def reading_points(prompts: int, warmup: int, every: int = READING_EVERY) -> list[int]:
    """How many prompts have run at each RSS reading: the warm-up's end, every ``every`` after it, the end."""
    return sorted({*range(warmup, prompts, every), prompts})


@dataclass
class SoakResult:
    seed: int
    prompts: int
    warmup: int
    outcomes: list[PromptOutcome] = field(default_factory=list)
    readings: list[tuple[int, int]] = field(default_factory=list)  # (prompts run, RSS bytes after the probe)
    max_drift: float = DEFAULT_MAX_DRIFT
    seconds: float = 0.0
    device: str = ""

    @property
    def failed(self) -> int:
        return sum(o.failed for o in self.outcomes)

    @property
    def _ends(self) -> int:
        return max(1, min(ENDS, len(self.readings) // 2))

    @property
    def _finished(self) -> bool:
        """Whether the end reading was taken: the drift needs it and one before it."""
        return len(self.readings) >= 2 and self.readings[-1][0] == self.prompts

    @property
    def rss_warm_bytes(self) -> int | None:
        """The median of the first readings; None before the end reading."""
        return int(statistics.median(rss for _, rss in self.readings[:self._ends])) if self._finished else None

    @property
    def rss_end_bytes(self) -> int | None:
        """The median of the last readings; None before the end reading."""
        return int(statistics.median(rss for _, rss in self.readings[-self._ends:])) if self._finished else None

    @property
    def drift(self) -> float | None:
        if self.rss_warm_bytes is None or self.rss_end_bytes is None:
            return None
        return drift(self.rss_warm_bytes, self.rss_end_bytes)

    def problems(self) -> list[str]:
        return problems(self.outcomes, self.drift, self.max_drift)

    def summary(self) -> str:
        mib = lambda value: "?" if value is None else f"{value / 2**20:,.0f} MiB"  # noqa: E731
        memory_drift = "?" if self.drift is None else f"{self.drift:+.2%}"
        ends = f"median of {self._ends} reading{'s' if self._ends > 1 else ''}"
        lines = [f"soak: {len(self.outcomes)}/{self.prompts} prompts run, {self.failed} failed, RSS {mib(self.rss_warm_bytes)} after "
                 f"{self.warmup} warm-up prompts, {mib(self.rss_end_bytes)} at the end ({ends} each; drift {memory_drift}, at most "
                 f"{self.max_drift:.1%} allowed), {self.seconds / 60:.1f} min, seed {self.seed}{f', {self.device}' if self.device else ''}"]
        if self.readings:
            lines.append("soak: RSS after the probe, by prompts run: "
                         + ", ".join(f"{count}: {rss / 2**20:,.0f} MiB" for count, rss in self.readings))
        found = self.problems()
        lines += [f"FAILED: {line}" for line in found] or ["passed"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"seed": self.seed, "prompts": self.prompts, "warmup": self.warmup, "run": len(self.outcomes), "failed": self.failed,
                "rss_warm_bytes": self.rss_warm_bytes, "rss_end_bytes": self.rss_end_bytes, "drift": self.drift,
                "readings": [{"prompts_run": count, "rss_bytes": rss} for count, rss in self.readings],
                "max_drift": self.max_drift, "minutes": self.seconds / 60, "device": self.device, "passed": not self.problems(),
                "problems": self.problems(), "outcomes": [asdict(o) for o in self.outcomes]}
