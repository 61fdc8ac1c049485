"""One decision per input signature: ``PerSignature`` decides once per signature (shapes, dtype,
device, mask) which backend runs and then runs it, recording an ``AttentionDecision``; its subclasses
decide (``dispatch``: a named backend, low memory; ``auto``: timed selection). ``summarize_decisions``
states the decisions for a report."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .backends import AttentionConfig, backend_function
from .config import AUTO, AttentionFn, dtype_name


@dataclass(frozen=True)
class AttentionDecision:
    """What ran for one input signature: the pick, the measured median seconds (auto) and the
    backends that were turned down, with reasons."""

    signature: str
    requested: str
    picked: str
    note: str = ""
    times_s: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


# a decision, and the pick's output on the inputs it was made on where deciding computed it
Decided = tuple[AttentionDecision, torch.Tensor | None]


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """The inputs that a decision depends on, as a readable key."""
    text = f"q {_dims(q)} k {_dims(k)} v {_dims(v)} {dtype_name(q.dtype)} {q.device}"
    if mask is not None:
        text += f" mask {_dims(mask)} {dtype_name(mask.dtype)}"
    return text


class PerSignature:
    """Decides once per input signature which backend runs, then runs it."""

    def __init__(self, config: AttentionConfig, on_decision: Callable[[AttentionDecision], None] | None = None):
        self.config = config
        self._on_decision = on_decision
        self._decisions: dict[str, AttentionDecision] = {}
        self._functions: dict[str, AttentionFn] = {}
        self._picks: set[str] = set()

    @property
    def decisions(self) -> list[AttentionDecision]:
        return list(self._decisions.values())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if len(self._picks) == 1 and torch.compiler.is_compiling():
            # One backend for every shape so far: looking the shape up would guard on it, and a
            # dynamic-shape compile would then recompile per resolution.
            (picked,) = self._picks
            return self._function(picked)(q, k, v, mask)
        # a tuple of shapes, not the readable string: torch.compile traces this lookup on every call
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, None if mask is None else (mask.shape, mask.dtype))
        decision = self._decisions.get(key)
        if decision is None:
            decision, out = self._decide(signature(q, k, v, mask), q, k, v, mask)
            self._decisions[key] = decision
            self._picks.add(decision.picked)
            if self._on_decision is not None:
                self._on_decision(decision)
            if out is not None:
                return out
        return self._function(decision.picked)(q, k, v, mask)

    def _function(self, name: str) -> AttentionFn:
        if name not in self._functions:
            self._functions[name] = backend_function(name, self.config)
        return self._functions[name]

    def _decide(self, key, q, k, v, mask) -> Decided:
        """The decision for this signature, and the pick's output on these inputs where deciding
        already computed it (the call then returns it rather than running attention again)."""
        raise NotImplementedError


def summarize_decisions(decisions: list[AttentionDecision]) -> tuple[str, str]:
    """(active, note) for a report: the distinct picks in order, the distinct notes, and (for
    auto) every backend turned down, each once."""
    picks = dict.fromkeys(d.picked for d in decisions)
    notes = dict.fromkeys(d.note for d in decisions if d.note)
    rejected = dict.fromkeys(f"{name} ({reason})" for d in decisions if d.requested == AUTO for name, reason in d.rejected.items())
    if rejected:
        notes["rejected: " + ", ".join(rejected)] = None
    return ", ".join(picks), "; ".join(notes)


def _dims(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape))
