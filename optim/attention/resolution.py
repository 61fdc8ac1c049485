"""Which backend runs a request for a named one: the requested backend where it can run, else (on
``"fallback"``) the first of ``FALLBACK_ORDER`` that can, with a note saying why, or ``UserError`` (on
``"error"``); and what a config will run before any tensor exists (``expected_backend``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import UserError
from .backends import AttentionConfig, Availability, available, backend_names, get_backend
from .config import AUTO, FALLBACK_ORDER, LOW_MEMORY, ON_UNAVAILABLE, SDPA_FUSED


@dataclass(frozen=True)
class Resolved:
    """The backend to use for a request, and a note saying why when it is not the one requested."""

    requested: str
    name: str
    note: str = ""

    @property
    def fell_back(self) -> bool:
        return self.name != self.requested


def resolve_backend(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    on_unavailable: str = "fallback",
) -> Resolved:
    """The backend that runs these tensors for a request of ``name``.

    ``"fallback"`` goes to the first of ``FALLBACK_ORDER`` that can run, with a note saying so;
    ``"error"`` raises ``UserError`` with the reason (which names the package or requirement).
    """
    return _resolve(name, lambda candidate: available(candidate, q, k, v, mask), on_unavailable)


class NoAttentionBackend(UserError):
    """Falling back found no backend that takes the inputs: a host with attention of its own runs
    its own for that call (``fallback`` never fails a prompt)."""


def resolve_backend_for_device(name: str, device: torch.device | str, on_unavailable: str = "fallback") -> Resolved:
    """Like ``resolve_backend`` before any tensor exists: checks the package and the device only."""
    return _resolve(name, lambda candidate: get_backend(candidate).check(device), on_unavailable)


AUTO_NOTE = "times every available exact backend on the first call of each input shape and keeps the fastest that matches naive"
LOW_MEMORY_NOTE = ("exact attention in the least memory: PyTorch's fused sdpa kernels (flash, memory-efficient; memory linear "
                   "in the tokens) where one takes the inputs, else sub_quadratic within the memory budget")


def expected_backend(config: AttentionConfig, device: torch.device | str) -> tuple[str, str]:
    """(active, note) for ``config`` before any tensor exists; ``on_unavailable="error"`` raises for a
    backend whose package or device is missing."""
    if config.backend == AUTO:
        return f"{AUTO} (pending)", AUTO_NOTE
    if config.backend == LOW_MEMORY:
        fused = get_backend(SDPA_FUSED).check(device)
        return (f"{SDPA_FUSED} (sub_quadratic for inputs no fused kernel takes)", LOW_MEMORY_NOTE) if fused.ok \
            else ("sub_quadratic", f"{LOW_MEMORY_NOTE}; here: {fused.reason}")
    resolved = resolve_backend_for_device(config.backend, device, config.on_unavailable)
    return resolved.name, resolved.note


def _resolve(name: str, check: Callable[[str], Availability], on_unavailable: str) -> Resolved:
    if on_unavailable not in ON_UNAVAILABLE:
        raise UserError(f"on_unavailable: must be one of {', '.join(ON_UNAVAILABLE)}, not {on_unavailable!r}")
    get_backend(name)
    verdict = check(name)
    if verdict.ok:
        return Resolved(name, name)
    if on_unavailable == "error":
        raise UserError(f"backend: {name} cannot run here: {verdict.reason}; pick another backend, or set on_unavailable to fallback")
    reasons = [f"{name}: {verdict.reason}"]
    for candidate in FALLBACK_ORDER:
        if candidate == name or candidate not in backend_names():
            continue
        fallback = check(candidate)
        if fallback.ok:
            return Resolved(name, candidate, f"fallback from {name} to {candidate}: {verdict.reason}")
        reasons.append(f"{candidate}: {fallback.reason}")
    raise NoAttentionBackend(f"backend: no attention backend can run here ({', '.join(reasons)})")
