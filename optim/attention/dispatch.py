"""The attention callable for a config (``build_attention``): the named backend resolved per
signature (``NamedAttention``), the least memory (``LowMemoryAttention``) or the timed choice
(``auto.AutoAttention``)."""
from __future__ import annotations

import warnings
from collections.abc import Callable

from .auto import AutoAttention
from .backends import AttentionConfig, Availability, available
from .config import AUTO, LOW_MEMORY, SDPA_FUSED
from .per_signature import AttentionDecision, Decided, PerSignature
from .resolution import resolve_backend


class NamedAttention(PerSignature):
    """The configured backend, resolved per signature with the config's ``on_unavailable``."""

    def _decide(self, key, q, k, v, mask) -> Decided:
        resolved = resolve_backend(self.config.backend, q, k, v, mask, self.config.on_unavailable)
        rejected = {resolved.requested: resolved.note} if resolved.fell_back else {}
        return AttentionDecision(key, resolved.requested, resolved.name, resolved.note, rejected=rejected), None


class LowMemoryAttention(PerSignature):
    """``sdpa_fused`` where one of PyTorch's fused kernels takes the signature (tried once on its
    first inputs: which kernel runs depends on dtype, head dim, mask, layout and the build),
    ``sub_quadratic`` within ``memory_budget_bytes`` elsewhere."""

    def _decide(self, key, q, k, v, mask) -> Decided:
        fused = available(SDPA_FUSED, q, k, v, mask)
        if fused.ok:
            try:
                with warnings.catch_warnings():  # torch warns once per kernel it turns down before raising
                    warnings.simplefilter("ignore")
                    out = self._function(SDPA_FUSED)(q, k, v, mask)
                return AttentionDecision(key, LOW_MEMORY, SDPA_FUSED), out
            except RuntimeError as error:
                fused = Availability(False, f"no fused sdpa kernel takes these inputs ({str(error).splitlines()[0]})")
        return AttentionDecision(key, LOW_MEMORY, "sub_quadratic", f"sub_quadratic: {fused.reason}", rejected={SDPA_FUSED: fused.reason}), None


def build_attention(
    config: AttentionConfig, on_decision: Callable[[AttentionDecision], None] | None = None
) -> PerSignature:
    """The attention callable for ``config``; ``on_decision`` hears each new per-signature decision."""
    if config.backend == AUTO:
        return AutoAttention(config, on_decision)
    if config.backend == LOW_MEMORY:
        return LowMemoryAttention(config, on_decision)
    return NamedAttention(config, on_decision)
