"""The callables ``build_attention`` returns: a named backend that falls back per signature, and low
memory (a fused sdpa kernel where one takes the inputs, sub_quadratic elsewhere)."""
import dataclasses

import torch

from sdopt.optim.attention import backends
from sdopt.optim.attention.backends import AttentionConfig, get_backend
from sdopt.optim.attention.config import LOW_MEMORY, SDPA_FUSED
from sdopt.optim.attention.dispatch import NamedAttention, build_attention
from sdopt.optim.attention.kernels import naive_attention
from sdopt.optim.attention.per_signature import summarize_decisions

from .support import missing, qkv, rows_seen


def test_named_attention_falls_back_per_signature(registered):
    registered(missing("needs_pkg", "needs-pkg"))
    seen = []
    attention = build_attention(AttentionConfig(backend="needs_pkg"), on_decision=seen.append)
    assert isinstance(attention, NamedAttention)
    q, k, v = qkv(1, 2, 8, 8, 16)
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v))
    attention(q, k, v)
    (decision,) = attention.decisions
    assert seen == [decision]
    assert decision.picked == "sdpa" and "pip install needs-pkg" in decision.rejected["needs_pkg"]
    assert summarize_decisions(attention.decisions) == ("sdpa", decision.note)


def test_low_memory_takes_a_fused_kernel_where_one_runs():
    q, k, v = qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=LOW_MEMORY))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (decision,) = attention.decisions
    # PyTorch's CPU flash kernel takes fp32 without a mask
    assert (decision.requested, decision.picked, decision.note) == (LOW_MEMORY, SDPA_FUSED, "")


def test_low_memory_falls_back_to_sub_quadratic_where_no_fused_kernel_runs(monkeypatch):
    def refusing(q, k, v, mask=None):
        raise RuntimeError("No available kernel. Aborting execution.\nmore detail")

    monkeypatch.setitem(backends._REGISTRY, SDPA_FUSED, dataclasses.replace(get_backend(SDPA_FUSED), fn=refusing))
    q, k, v = qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=LOW_MEMORY, memory_budget_bytes=4096))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (decision,) = attention.decisions
    assert decision.picked == "sub_quadratic"
    assert decision.rejected == {SDPA_FUSED: "no fused sdpa kernel takes these inputs (No available kernel. Aborting execution.)"}
    assert summarize_decisions(attention.decisions) == ("sub_quadratic", f"sub_quadratic: {decision.rejected[SDPA_FUSED]}")


def test_low_memory_returns_its_trial_of_the_fused_kernel_as_the_first_calls_output(monkeypatch):
    seen = []
    fused = get_backend(SDPA_FUSED)
    monkeypatch.setitem(backends._REGISTRY, SDPA_FUSED, rows_seen(SDPA_FUSED, fused.fn, seen))
    q, k, v = qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=LOW_MEMORY))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert seen == [64], "the trial that found a fused kernel is the call"
    attention(q, k, v)
    assert seen == [64, 64]
