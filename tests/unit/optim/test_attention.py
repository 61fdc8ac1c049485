"""Attention backends on CPU: each one against naive, masks, availability reasons, fallback, auto,
the layout adapters, and the rule that optim/ never imports a host or the measurement code."""
import ast
import dataclasses
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from sdopt.errors import UserError
from sdopt.optim import attention as A
from sdopt.optim import attention_auto
from sdopt.optim.attention import (
    AUTO,
    AttentionConfig,
    Backend,
    Limits,
    NamedAttention,
    available,
    backend_function,
    backend_names,
    runs_low_precision,
    build_attention,
    get_backend,
    naive_attention,
    register_backend,
    resolve_backend,
    resolve_backend_for_device,
    sub_quadratic_chunks,
    summarize_decisions,
    unregister_backend,
)
from sdopt.optim.attention_auto import AUTO_REPEATS, AutoAttention, check_against_naive, time_attention

# Largest |backend - naive| accepted here, per input dtype. Measured: fp32 stays near 1e-6;
# bf16 near 8e-3 (one bf16 ulp at |out| ~ 1-2, from SDPA's bf16 matmuls).
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
# Budgets small enough that sliced and sub_quadratic cut these shapes into several slices and
# key chunks (the online softmax really rescales).
TINY_BUDGET = 64 * 1024
CONFIGS = {"default": AttentionConfig(), "tiny-budget": AttentionConfig(memory_budget_bytes=TINY_BUDGET)}
CPU_BACKENDS = [name for name in backend_names() if get_backend(name).check("cpu").ok]
# (batch, heads, query tokens, key tokens, head dim): odd token counts, CLIP's 77-token context,
# SD head dims 40/64/80/160, batch > 1.
SHAPES = [
    (1, 8, 77, 77, 40),
    (2, 4, 333, 77, 64),
    (2, 2, 333, 333, 80),
    (3, 2, 129, 77, 160),
]
OPTIONAL = {"xformers": "xformers", "sage": "sageattention", "flash_attn": "flash-attn"}


def _qkv(batch, heads, q_tokens, k_tokens, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_tokens, head_dim, generator=generator)
    k = torch.randn(batch, heads, k_tokens, head_dim, generator=generator)
    v = torch.randn(batch, heads, k_tokens, head_dim, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _max_error(out, q, k, v, mask=None):
    return (out.float() - naive_attention(q, k, v, mask).float()).abs().max().item()


@pytest.fixture
def registered():
    """Register test backends (or replacements) and restore the registry afterwards."""
    before = {name: get_backend(name) for name in backend_names()}
    order = list(before)

    def register(backend):
        register_backend(backend, replace=True)
        return backend.name

    yield register
    for name in backend_names():
        unregister_backend(name)
    for name in order:
        register_backend(before[name])


def test_cpu_has_the_portable_backends():
    assert {"sdpa", "sdpa_math", "sliced", "sub_quadratic", "naive"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_matches_naive_fp32(name, config, shape):
    q, k, v = _qkv(*shape)
    out = backend_function(name, config)(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _max_error(out, q, k, v) <= ATOL[torch.float32]


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_matches_naive_bf16(name):
    q, k, v = _qkv(2, 4, 333, 77, 64, torch.bfloat16)
    out = backend_function(name, CONFIGS["tiny-budget"])(q, k, v)
    assert out.dtype == torch.bfloat16
    assert _max_error(out, q, k, v) <= ATOL[torch.bfloat16]


def _masks(batch, heads, q_tokens, k_tokens):
    generator = torch.Generator().manual_seed(1)
    keep = torch.rand(1, 1, 1, k_tokens, generator=generator) > 0.3
    keep[..., 0] = True  # no row is fully masked
    return {
        "additive-batch": torch.randn(batch, 1, q_tokens, k_tokens, generator=generator),
        "additive-per-head": torch.randn(batch, heads, q_tokens, k_tokens, generator=generator),
        "additive-2d": torch.randn(q_tokens, k_tokens, generator=generator),
        "bool-key-padding": keep,
    }


@pytest.mark.parametrize("mask_kind", ["additive-batch", "additive-per-head", "additive-2d", "bool-key-padding"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_backend_with_mask_matches_naive(name, mask_kind):
    shape = (2, 4, 333, 77, 64)
    q, k, v = _qkv(*shape)
    mask = _masks(2, 4, 333, 77)[mask_kind]
    assert available(name, q, k, v, mask).ok
    out = backend_function(name, CONFIGS["tiny-budget"])(q, k, v, mask)
    assert _max_error(out, q, k, v, mask) <= ATOL[torch.float32]


def test_bool_mask_is_additive_minus_infinity():
    q, k, v = _qkv(1, 2, 5, 6, 8)
    keep = torch.tensor([True, False, True, True, False, True])
    bias = torch.zeros(6).masked_fill(~keep, -math.inf)
    torch.testing.assert_close(naive_attention(q, k, v, keep), naive_attention(q, k, v, bias))
    torch.testing.assert_close(naive_attention(q, k, v, keep), naive_attention(q, k[:, :, keep], v[:, :, keep]))


def test_sub_quadratic_handles_key_chunks_that_are_entirely_masked():
    q, k, v = _qkv(1, 2, 100, 512, 16)
    keep = torch.zeros(512, dtype=torch.bool)
    keep[400:] = True  # the first key chunks hold nothing to attend to
    budget = 2 * 2 * 4 * 64 * 64  # 64 x 64 chunks over 2 rows
    assert sub_quadratic_chunks(2, 100, 512, 4, budget)[1] == 64
    out = A.sub_quadratic_attention(q, k, v, keep, memory_budget_bytes=budget)
    assert torch.isfinite(out).all()
    assert _max_error(out, q, k, v, keep) <= ATOL[torch.float32]


def test_sub_quadratic_chunks_fit_the_budget_and_chunk_the_keys():
    rows, tokens, size = 8, 4096, 4
    q_chunk, kv_chunk = sub_quadratic_chunks(rows, tokens, tokens, size, A.DEFAULT_MEMORY_BUDGET_BYTES)
    assert kv_chunk < tokens and q_chunk < tokens, "4096 x 4096 at the default budget needs key and query chunks"
    assert 2 * rows * q_chunk * kv_chunk * size <= A.DEFAULT_MEMORY_BUDGET_BYTES
    assert sub_quadratic_chunks(rows, 77, 77, size, A.DEFAULT_MEMORY_BUDGET_BYTES) == (77, 77)


def test_sliced_by_heads_and_explicit_slice_size():
    q, k, v = _qkv(2, 8, 333, 77, 40)
    mask = _masks(2, 8, 333, 77)["additive-per-head"]
    out = A.sliced_attention(q, k, v, mask, slice_size=50, head_slice_size=3)
    assert _max_error(out, q, k, v, mask) <= ATOL[torch.float32]


def test_naive_computes_half_inputs_in_fp32():
    q, k, v = _qkv(1, 2, 33, 33, 16, torch.bfloat16)
    expected = naive_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)
    assert torch.equal(naive_attention(q, k, v), expected)


def test_only_quantizing_backends_run_low_precision():
    assert runs_low_precision("sage")
    assert not any(runs_low_precision(name) for name in (*backend_names(), AUTO, "low_memory") if name != "sage")


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_missing_optional_packages_are_named_with_pip(name):
    package = OPTIONAL[name]
    q, k, v = _qkv(1, 2, 8, 8, 64, torch.float16)
    verdict = available(name, q, k, v)
    if verdict.ok or "not installed" not in verdict.reason:
        pytest.skip(f"{package} is installed here")
    assert not verdict.ok
    assert verdict.reason == f"{package} is not installed: pip install {package}"


def test_device_dtype_head_dim_and_mask_reasons():
    q, k, v = _qkv(1, 2, 8, 8, 64)
    assert available("sdpa_efficient", q, k, v).reason == "sdpa_efficient needs CUDA"
    flash = get_backend("sdpa_flash")
    assert flash.check("cuda", torch.float32).reason == "sdpa_flash on cuda supports float16, bfloat16 (got float32)"
    assert flash.check("cuda", torch.float16, head_dim=512).reason == "sdpa_flash supports head dim <= 256 (got 512)"
    assert flash.check("cuda", torch.float16, 64, has_mask=True).reason == "sdpa_flash on cuda does not support attention masks"
    assert flash.check("cuda", torch.float16, 64).ok
    assert available("naive", q.double(), k.double(), v.double()).reason.startswith("naive on cpu supports float32")
    elsewhere = Backend("elsewhere", naive_attention, {"cuda": Limits(), "xpu": Limits()})
    assert elsewhere.check("cpu").reason == "elsewhere does not run on cpu (runs on: cuda, xpu)"


def test_shape_problems_are_reported():
    q, k, v = _qkv(1, 2, 8, 9, 16)
    assert not available("sdpa", q, k[:, :1], v).ok
    assert not available("sdpa", q, k, v, torch.zeros(8, 5)).ok
    assert available("sdpa", q, k, v, torch.zeros(8, 9)).ok
    assert "unknown" in available("nope", q, k, v).reason


def _missing(name, pip):
    """A backend that needs a package that is not installed anywhere."""
    return Backend(name, naive_attention, {A.ANY_DEVICE: Limits()}, module=f"sdopt_missing_{name}", pip=pip)


def test_fallback_goes_to_sdpa_with_a_note(registered):
    registered(_missing("needs_pkg", "needs-pkg"))
    q, k, v = _qkv(1, 2, 8, 8, 16)
    resolved = resolve_backend("needs_pkg", q, k, v, on_unavailable="fallback")
    assert resolved.name == "sdpa" and resolved.fell_back
    assert resolved.note == "fallback from needs_pkg to sdpa: needs-pkg is not installed: pip install needs-pkg"
    assert resolve_backend("sliced", q, k, v) == A.Resolved("sliced", "sliced")


def test_fallback_skips_sdpa_when_it_cannot_run(registered):
    registered(dataclasses.replace(get_backend("sdpa"), limits={"cuda": Limits()}))
    q, k, v = _qkv(1, 2, 8, 8, 16)
    resolved = resolve_backend("sdpa_efficient", q, k, v)
    assert resolved.name == "sub_quadratic"
    assert "fallback from sdpa_efficient to sub_quadratic" in resolved.note


def test_error_mode_raises_one_line_naming_the_requirement(registered):
    registered(_missing("needs_pkg", "needs-pkg"))
    q, k, v = _qkv(1, 2, 8, 8, 16)
    with pytest.raises(UserError) as error:
        resolve_backend("needs_pkg", q, k, v, on_unavailable="error")
    assert "pip install needs-pkg" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="needs CUDA"):
        resolve_backend_for_device("sdpa_efficient", "cpu", "error")
    assert resolve_backend_for_device("sdpa_efficient", "cuda", "error").name == "sdpa_efficient"


def test_nothing_can_run_raises_its_own_user_error():
    """Its own class, so that a host with attention of its own runs that instead (the nodes' fallback)."""
    q, k, v = _qkv(1, 2, 8, 8, 16, torch.float64)
    with pytest.raises(A.NoAttentionBackend, match="no attention backend can run here") as error:
        resolve_backend("sdpa", q, k, v)
    assert isinstance(error.value, UserError)


def test_config_is_validated():
    with pytest.raises(UserError, match="on_unavailable"):
        AttentionConfig(on_unavailable="ignore")
    with pytest.raises(UserError, match="choose from auto, low_memory, sdpa"):
        AttentionConfig(backend="sdap")
    with pytest.raises(UserError):
        AttentionConfig(memory_budget_bytes=0)
    assert AttentionConfig(backend=AUTO).backend == AUTO


def test_named_attention_falls_back_per_signature(registered):
    registered(_missing("needs_pkg", "needs-pkg"))
    seen = []
    attention = build_attention(AttentionConfig(backend="needs_pkg"), on_decision=seen.append)
    assert isinstance(attention, NamedAttention)
    q, k, v = _qkv(1, 2, 8, 8, 16)
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v))
    attention(q, k, v)
    (decision,) = attention.decisions
    assert seen == [decision]
    assert decision.picked == "sdpa" and "pip install needs-pkg" in decision.rejected["needs_pkg"]
    assert summarize_decisions(attention.decisions) == ("sdpa", decision.note)


def test_low_memory_takes_a_fused_kernel_where_one_runs():
    q, k, v = _qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=A.LOW_MEMORY))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (decision,) = attention.decisions
    # PyTorch's CPU flash kernel takes fp32 without a mask
    assert (decision.requested, decision.picked, decision.note) == (A.LOW_MEMORY, A.SDPA_FUSED, "")


def test_low_memory_falls_back_to_sub_quadratic_where_no_fused_kernel_runs(monkeypatch):
    def refusing(q, k, v, mask=None):
        raise RuntimeError("No available kernel. Aborting execution.\nmore detail")

    monkeypatch.setitem(A._REGISTRY, A.SDPA_FUSED, dataclasses.replace(get_backend(A.SDPA_FUSED), fn=refusing))
    q, k, v = _qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=A.LOW_MEMORY, memory_budget_bytes=4096))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (decision,) = attention.decisions
    assert decision.picked == "sub_quadratic"
    assert decision.rejected == {A.SDPA_FUSED: "no fused sdpa kernel takes these inputs (No available kernel. Aborting execution.)"}
    assert summarize_decisions(attention.decisions) == ("sub_quadratic", f"sub_quadratic: {decision.rejected[A.SDPA_FUSED]}")


def test_low_memory_on_a_device_without_fused_kernels_says_sub_quadratic_before_it_runs():
    assert A.expected_backend(AttentionConfig(backend=A.LOW_MEMORY), "cpu")[0].startswith(A.SDPA_FUSED)
    active, note = A.expected_backend(AttentionConfig(backend=A.LOW_MEMORY), "mps")
    assert active == "sub_quadratic" and note.startswith(A.LOW_MEMORY_NOTE) and "mps" in note


def test_selections_are_reserved_names():
    for name in A.SELECTIONS:
        with pytest.raises(ValueError, match="reserved"):
            register_backend(Backend(name, naive_attention, {A.ANY_DEVICE: Limits()}))


def _counting(name, fn, calls):
    def counted(q, k, v, mask=None):
        calls.append(name)
        return fn(q, k, v, mask)

    return Backend(name, counted, {A.ANY_DEVICE: Limits()})


def test_auto_rejects_a_wrong_backend_even_when_it_is_fastest(registered):
    calls = []
    registered(_counting("zeros", lambda q, k, v, mask=None: torch.zeros_like(q), calls))
    registered(_counting("raises", lambda q, k, v, mask=None: 1 / 0, calls))
    attention = AutoAttention(candidates=("zeros", "raises", "naive", "sdpa"))
    q, k, v = _qkv(2, 2, 77, 77, 40)
    out = attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.requested == AUTO
    assert decision.picked in ("naive", "sdpa")
    assert set(decision.times_s) == {"naive", "sdpa"} and all(t > 0 for t in decision.times_s.values())
    assert "exceeds the float32 tolerance (atol 0.0001 + rtol 0.0001)" in decision.rejected["zeros"]
    assert decision.rejected["raises"].startswith("failed: ZeroDivisionError")
    assert _max_error(out, q, k, v) <= ATOL[torch.float32]
    active, note = summarize_decisions(attention.decisions)
    assert active == decision.picked and "rejected: zeros (max abs error" in note


def test_auto_picks_the_fastest_by_median(registered, monkeypatch):
    """The timings are stubbed (unit tests never depend on real speed); the choice logic is not."""
    seconds = {"steady": [3.0, 3.0, 3.0], "spiky": [9.0, 1.0, 2.0], "slow": [5.0, 5.0, 5.0]}
    for name in seconds:
        registered(_counting(name, naive_attention, []))
    names_by_fn = {get_backend(name).fn: name for name in seconds}
    monkeypatch.setattr(attention_auto, "time_attention", lambda fn, *args, **kwargs: seconds[names_by_fn[fn]])
    attention = AutoAttention(candidates=("slow", "steady", "spiky"))
    q, k, v = _qkv(1, 2, 8, 8, 16)
    attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.times_s == {"slow": 5.0, "steady": 3.0, "spiky": 2.0}
    assert decision.picked == "spiky"


def test_auto_never_picks_a_quantizing_backend_even_when_it_is_exact_and_fastest(registered, monkeypatch):
    """The timings are stubbed: ``quantized`` is the fastest and its output is naive's, and it still
    is no candidate."""
    registered(Backend("quantized", naive_attention, {A.ANY_DEVICE: Limits()}, "8-bit QK stand-in", low_precision=True))
    monkeypatch.setattr(attention_auto, "time_attention", lambda fn, *args, **kwargs: [0.1] if fn is naive_attention else [1.0])
    attention = AutoAttention(candidates=("quantized", "sdpa"))
    attention(*_qkv(1, 2, 8, 8, 16))
    (decision,) = attention.decisions
    assert decision.picked == "sdpa" and set(decision.times_s) == {"sdpa"}
    assert decision.rejected["quantized"] == ("quantizes inside (8-bit QK stand-in); auto keeps exact backends, "
                                              "choose quantized by name to run it")


@pytest.mark.parametrize("free, tried", [(100_000, {"sdpa", "sub_quadratic"}), (10**9, {"naive", "sdpa_math", "sdpa", "sub_quadratic"})],
                         ids=["scores-past-half-free", "scores-fit"])
def test_auto_tries_a_backend_that_holds_the_scores_only_where_they_fit(monkeypatch, free, tried):
    """q, k [1, 2, 64, 16] fp32: naive's and sdpa_math's scores and softmax take 2 x 2 x 64 x 64 x 4 = 65,536 bytes."""
    monkeypatch.setattr(attention_auto, "free_memory", lambda device: free)
    attention = AutoAttention(candidates=("naive", "sdpa_math", "sdpa", "sub_quadratic"))
    attention(*_qkv(1, 2, 64, 64, 16))
    (decision,) = attention.decisions
    assert set(decision.times_s) == tried
    for name in {"naive", "sdpa_math"} - tried:
        assert decision.rejected[name] == "not tried: its query-by-key scores would take 0.1 MiB, more than 50% of the 0.1 MiB free on cpu"


def test_auto_computes_the_naive_reference_once_for_all_its_candidates(monkeypatch):
    """naive's output is the costliest part of a decision on a CPU: one per signature, not one per candidate."""
    references = []
    real = attention_auto.naive_attention
    monkeypatch.setattr(attention_auto, "naive_attention", lambda *args: references.append(1) or real(*args))
    attention = AutoAttention(candidates=("sdpa", "sliced", "sub_quadratic"), repeats=1)
    attention(*_qkv(1, 2, 64, 64, 16))
    (decision,) = attention.decisions
    assert set(decision.times_s) == {"sdpa", "sliced", "sub_quadratic"}
    assert len(references) == 1, "one block of rows fits the budget, computed once"


def _rows_seen(name, fn, seen):
    """A backend that records how many query rows each call hands it."""
    def recorded(q, k, v, mask=None):
        seen.append(q.shape[2])
        return fn(q, k, v, mask)

    return Backend(name, recorded, {A.ANY_DEVICE: Limits()})


def test_auto_times_a_long_sequence_on_rows_through_all_of_it_and_runs_its_pick_once_whole(registered, monkeypatch):
    """Past TRIAL_QUERY_ROWS each trial takes an even stride of the rows (all of the mask's part for
    them), and only the pick runs on every row before the decision stands."""
    monkeypatch.setattr(attention_auto, "TRIAL_QUERY_ROWS", 16)
    seen = []
    registered(_rows_seen("recorded", naive_attention, seen))
    q, k, v = _qkv(1, 2, 64, 40, 16)
    mask = torch.randn(64, 40)
    attention = AutoAttention(candidates=("recorded",), repeats=2)
    out = attention(q, k, v, mask)
    assert seen == [16, 16, 16, 64], "check and two timed calls on 16 rows, then the whole call, checked and returned"
    (decision,) = attention.decisions
    assert decision.note.endswith("timed on 16 of its 64 query rows")
    assert torch.allclose(out, naive_attention(q, k, v, mask))


def test_auto_turns_down_a_pick_that_is_right_on_the_trial_rows_only(registered, monkeypatch):
    """A kernel may change with the size: the fastest on the trial rows that fails on the whole call,
    or raises there, is turned down with the reason and the next fastest is picked."""
    monkeypatch.setattr(attention_auto, "TRIAL_QUERY_ROWS", 16)

    def wrong_when_long(q, k, v, mask=None):
        out = naive_attention(q, k, v, mask)
        return out if q.shape[2] <= 16 else out + 1

    def raises_when_long(q, k, v, mask=None):
        if q.shape[2] > 16:
            raise RuntimeError("no kernel for this size")
        return naive_attention(q, k, v, mask)

    registered(Backend("wrong_when_long", wrong_when_long, {A.ANY_DEVICE: Limits()}))
    registered(Backend("raises_when_long", raises_when_long, {A.ANY_DEVICE: Limits()}))
    monkeypatch.setattr(attention_auto, "time_attention", lambda fn, *args, **kwargs: {
        "wrong_when_long": [1.0], "raises_when_long": [2.0]}.get(fn.__name__, [3.0]))
    attention = AutoAttention(candidates=("wrong_when_long", "raises_when_long", "naive"))
    q, k, v = _qkv(1, 2, 64, 40, 16)
    out = attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.picked == "naive" and set(decision.times_s) == {"naive"}
    assert decision.rejected["wrong_when_long"].startswith("on all 64 query rows: max abs error 1.00e+00 vs naive exceeds")
    assert decision.rejected["raises_when_long"] == "failed on all 64 query rows: RuntimeError: no kernel for this size"
    assert torch.equal(out, naive_attention(q, k, v))


def test_auto_short_sequences_are_timed_whole_and_not_run_twice(registered):
    seen = []
    registered(_rows_seen("recorded", naive_attention, seen))
    attention = AutoAttention(candidates=("recorded",), repeats=1)
    attention(*_qkv(1, 2, attention_auto.TRIAL_QUERY_ROWS, 40, 16))
    assert seen == [attention_auto.TRIAL_QUERY_ROWS] * 2, "the check, whose output the call returns, and one timed call"
    assert "timed on" not in attention.decisions[0].note


@pytest.mark.parametrize("times, returned", [({"first": [2.0], "second": [1.0]}, "second"),
                                             ({"first": [1.0], "second": [1.0]}, "first")], ids=["faster-later", "tie"])
def test_auto_returns_the_picks_own_output_from_the_call_that_decides(registered, monkeypatch, times, returned):
    """The first call returns the output deciding computed, so it must be the pick's (a tie goes to the
    candidate tried first), and every later call runs the pick."""
    offsets = {"first": 1e-7, "second": 2e-7}
    for name, offset in offsets.items():
        def shifted(q, k, v, mask=None, offset=offset):
            return naive_attention(q, k, v, mask) + offset

        shifted.__name__ = name
        registered(Backend(name, shifted, {A.ANY_DEVICE: Limits()}))
    monkeypatch.setattr(attention_auto, "time_attention", lambda fn, *args, **kwargs: times[fn.__name__])
    attention = AutoAttention(candidates=("first", "second"))
    q, k, v = _qkv(1, 2, 32, 40, 16)
    expected = naive_attention(q, k, v) + offsets[returned]
    assert torch.equal(attention(q, k, v), expected)
    assert attention.decisions[0].picked == returned
    assert torch.equal(attention(q, k, v), expected)


def test_low_memory_returns_its_trial_of_the_fused_kernel_as_the_first_calls_output(monkeypatch):
    seen = []
    fused = get_backend(A.SDPA_FUSED)
    monkeypatch.setitem(A._REGISTRY, A.SDPA_FUSED, _rows_seen(A.SDPA_FUSED, fused.fn, seen))
    q, k, v = _qkv(1, 2, 64, 64, 16)
    attention = build_attention(AttentionConfig(backend=A.LOW_MEMORY))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert seen == [64], "the trial that found a fused kernel is the call"
    attention(q, k, v)
    assert seen == [64, 64]


def test_a_quantizing_backend_is_held_to_bf16s_bound_where_its_dtype_is_tighter():
    quantized = Backend("quantized", naive_attention, {A.ANY_DEVICE: Limits()}, low_precision=True)
    exact = get_backend("sdpa")
    assert quantized.tolerance(torch.float16) == A.TOLERANCE_BF16 and exact.tolerance(torch.float16) == A.TOLERANCE_FP16
    assert quantized.tolerance(torch.bfloat16) == exact.tolerance(torch.bfloat16) == A.TOLERANCE_BF16
    assert quantized.tolerance(torch.float32) == A.TOLERANCE_BF16 and exact.tolerance(torch.float32) == A.TOLERANCE_FP32


def test_auto_decides_once_per_signature(registered):
    calls = []
    registered(_counting("counted", naive_attention, calls))
    seen = []
    attention = AutoAttention(on_decision=seen.append, candidates=("counted", "sdpa"), repeats=2)
    q, k, v = _qkv(1, 2, 40, 40, 16)
    attention(q, k, v)
    assert len(calls) == 1 + 2, "one checked call and two timed; picked or not, the checked output is the call's own"
    attention(q, k, v)
    assert len(attention.decisions) == 1 and len(seen) == 1, "same signature: cached"
    attention(q[:, :, :20], k, v)
    mask = torch.zeros(40, 40)
    attention(q, k, v, mask)
    assert len(attention.decisions) == 3 and len(seen) == 3, "shape and mask presence are part of the signature"
    assert len({d.signature for d in attention.decisions}) == 3


def test_auto_is_the_default_candidate_set_and_skips_unavailable():
    attention = build_attention(AttentionConfig(backend=AUTO))
    assert isinstance(attention, AutoAttention)
    q, k, v = _qkv(1, 2, 16, 16, 8)
    attention(q, k, v)
    (decision,) = attention.decisions
    assert set(decision.times_s) | set(decision.rejected) == set(backend_names())
    assert decision.rejected["sdpa_efficient"] == "sdpa_efficient needs CUDA"


@pytest.fixture
def fake_packages(monkeypatch):
    """Stand-ins for xformers, sageattention and flash_attn that compute naive attention in
    each library's documented layout, so the adapters' transposes and mask handling are tested."""
    seen = {}

    def memory_efficient_attention(q, k, v, attn_bias=None):  # [B, N, H, D]
        if attn_bias is not None:
            seen["bias"] = attn_bias
            assert attn_bias.shape == (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
            assert attn_bias.stride(-2) % 8 == 0, "xformers needs the bias rows aligned to 8"
        return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias).transpose(1, 2)

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False):
        assert tensor_layout == "HND" and not is_causal
        return naive_attention(q, k, v)

    def flash_attn_func(q, k, v, dropout_p=0.0, causal=False):  # [B, N, H, D]
        assert dropout_p == 0.0 and not causal
        return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    xformers = types.ModuleType("xformers")
    xformers.ops = types.ModuleType("xformers.ops")
    xformers.ops.memory_efficient_attention = memory_efficient_attention
    for name, module in {
        "xformers": xformers,
        "xformers.ops": xformers.ops,
        "sageattention": types.SimpleNamespace(sageattn=sageattn),
        "flash_attn": types.SimpleNamespace(flash_attn_func=flash_attn_func),
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return seen


@pytest.mark.parametrize("name", ["xformers", "sage", "flash_attn"])
def test_optional_adapters_keep_the_layout(fake_packages, name):
    q, k, v = _qkv(2, 4, 33, 77, 64)
    assert available(name, q, k, v).reason == f"{name} needs CUDA", "installed now: only the device is missing"
    out = get_backend(name).fn(q, k, v)
    assert _max_error(out, q, k, v) <= ATOL[torch.float32]


def test_xformers_adapter_builds_an_aligned_bias(fake_packages):
    q, k, v = _qkv(2, 4, 33, 77, 64)
    mask = _masks(2, 4, 33, 77)["bool-key-padding"]
    out = A.xformers_attention(q, k, v, mask)
    assert fake_packages["bias"].dtype == q.dtype
    assert _max_error(out, q, k, v, mask) <= ATOL[torch.float32]


# -- checking against naive and timing (attention_auto) ------------------------------------------


def test_check_against_naive_accepts_the_reference_and_names_the_tolerance():
    q, k, v = _qkv(2, 2, 50, 30, 16)
    exact = check_against_naive(naive_attention(q, k, v), q, k, v)
    assert exact.ok and exact.max_abs_error == 0.0 and exact.reason == ""
    off = naive_attention(q, k, v)
    off[1, 1, -1, -1] += 1e-2  # the last row of the last block only
    check = check_against_naive(off, q, k, v, memory_budget_bytes=2 * 2 * 2 * 30 * 4 * 7)  # 7-row blocks
    assert not check.ok and check.max_abs_error == pytest.approx(1e-2, rel=1e-3)
    assert check.reason == "max abs error 1.00e-02 vs naive exceeds the float32 tolerance (atol 0.0001 + rtol 0.0001)"
    loose = check_against_naive(off, q, k, v, tolerance=A.Tolerance(atol=2e-2, rtol=0))
    assert loose.ok and loose.max_abs_error == pytest.approx(1e-2, rel=1e-3)


def test_check_against_naive_uses_the_dtype_tolerance():
    q, k, v = _qkv(1, 2, 20, 20, 16, torch.bfloat16)
    out = naive_attention(q, k, v)
    assert check_against_naive(out, q, k, v).ok
    bad = (out.float() + 0.1).to(torch.bfloat16)
    check = check_against_naive(bad, q, k, v)
    assert not check.ok and "bfloat16 tolerance (atol 0.03 + rtol 0.03)" in check.reason


def test_check_against_naive_wrong_shape_and_nan():
    q, k, v = _qkv(1, 2, 8, 8, 16)
    wrong = check_against_naive(torch.zeros(1, 2, 8, 15), q, k, v)
    assert not wrong.ok and wrong.max_abs_error == math.inf and wrong.reason == "output shape [1, 2, 8, 15] instead of [1, 2, 8, 16]"
    nan = naive_attention(q, k, v)
    nan[0, 0, 3, 0] = float("nan")
    check = check_against_naive(nan, q, k, v)
    assert not check.ok and check.max_abs_error == math.inf, "NaN where the reference is finite is wrong"


def test_check_against_naive_agrees_on_fully_masked_rows():
    q, k, v = _qkv(1, 2, 6, 5, 8)
    keep = torch.ones(6, 5, dtype=torch.bool)
    keep[2] = False  # query 2 sees no key: naive gives NaN there
    reference = naive_attention(q, k, v, keep)
    assert reference[:, :, 2].isnan().all() and not reference[:, :, :2].isnan().any()
    assert check_against_naive(reference, q, k, v, keep).ok
    zeros = reference.nan_to_num()
    assert not check_against_naive(zeros, q, k, v, keep).ok, "a number where the reference has NaN is not agreement"


def test_time_attention_calls_each_repeat():
    calls = []
    q, k, v = _qkv(1, 2, 8, 8, 16)
    mask = torch.zeros(8, 8)
    seconds = time_attention(lambda *args: calls.append(args), q, k, v, mask)
    assert AUTO_REPEATS == 3 and len(seconds) == AUTO_REPEATS == len(calls)
    assert all(s >= 0 for s in seconds) and all(c[3] is mask for c in calls)
    assert len(time_attention(naive_attention, q, k, v, repeats=5)) == 5
    assert AutoAttention().repeats == AUTO_REPEATS


# -- layouts ---------------------------------------------------------------------------------------


def _sdpa_reference(q, k, v, heads, mask=None):
    """SDPA on [B, N, H*D] inputs, split into heads by hand."""
    batch = q.shape[0]
    split = [t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, -1, heads * out.shape[-1])


def _packed(batch=2, q_tokens=33, k_tokens=77, heads=4, head_dim=16, dtype=torch.float32, v_dim=None):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, q_tokens, heads * head_dim, generator=g)
    k = torch.randn(batch, k_tokens, heads * head_dim, generator=g)
    v = torch.randn(batch, k_tokens, heads * (v_dim or head_dim), generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("name", ["sdpa", "naive", "sub_quadratic"])
def test_packed_heads_matches_sdpa(name):
    q, k, v = _packed()
    run = A.packed_heads(backend_function(name, CONFIGS["tiny-budget"]))
    out = run(q, k, v, 4)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_with_another_value_dim():
    q, k, v = _packed(v_dim=24)
    out = A.packed_heads(naive_attention)(q, k, v, 4)
    assert out.shape == (2, 33, 4 * 24)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_takes_any_input_already_split_into_heads():
    """SD3's MMDiT packs q and k but hands v over as [B, N, heads, D] (ComfyUI's own attention
    reshapes every input by q's head width)."""
    q, k, v = _packed()
    split_v = v.view(v.shape[0], -1, 4, 16)
    out = A.packed_heads(naive_attention)(q, k, split_v, 4)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, 4), atol=ATOL[torch.float32], rtol=0)


def test_packed_heads_skip_reshape_and_skip_output_reshape():
    q, k, v = _packed()
    heads, batch = 4, q.shape[0]
    split = [t.view(batch, -1, heads, 16).transpose(1, 2) for t in (q, k, v)]
    expected = _sdpa_reference(q, k, v, heads)
    expected_split = expected.view(batch, -1, heads, 16).transpose(1, 2)
    run = A.packed_heads(naive_attention)
    tol = dict(atol=ATOL[torch.float32], rtol=0)
    torch.testing.assert_close(run(*split, heads, skip_reshape=True), expected, **tol)
    out = run(*split, heads, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (batch, heads, 33, 16)
    torch.testing.assert_close(out, expected_split, **tol)
    out = run(q, k, v, heads, skip_output_reshape=True)
    assert out.shape == (batch, heads, 33, 16)
    torch.testing.assert_close(out, expected_split, **tol)


@pytest.mark.parametrize("kind", ["additive-2d", "additive-3d", "bool-2d", "bool-3d"])
def test_packed_heads_masks_gain_the_missing_dims(kind):
    q, k, v = _packed()
    g = torch.Generator().manual_seed(8)
    shape = (33, 77) if kind.endswith("2d") else (2, 33, 77)
    if kind.startswith("bool"):
        mask = torch.rand(shape, generator=g) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(shape, generator=g)
    as_4d = mask.view(1, 1, 33, 77) if mask.ndim == 2 else mask.unsqueeze(1)
    expected = _sdpa_reference(q, k, v, 4, as_4d)
    for name in ("sdpa", "naive", "sliced"):
        out = A.packed_heads(backend_function(name, CONFIGS["tiny-budget"]))(q, k, v, 4, mask)
        torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
    assert not torch.allclose(expected, _sdpa_reference(q, k, v, 4)), "the mask matters"


def test_packed_heads_upcast_computes_in_fp32_and_returns_the_input_dtype():
    seen = []

    def recording(q, k, v, mask=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return naive_attention(q, k, v, mask)

    run = A.packed_heads(recording)
    q, k, v = _packed(dtype=torch.bfloat16)
    out = run(q, k, v, 4, upcast=True)
    assert seen[-1] == (torch.float32,) * 3 and out.dtype == torch.bfloat16
    expected = _sdpa_reference(q.float(), k.float(), v.float(), 4).to(torch.bfloat16)
    assert torch.equal(out, A.packed_heads(naive_attention)(q.float(), k.float(), v.float(), 4).to(torch.bfloat16))
    torch.testing.assert_close(out, expected, atol=ATOL[torch.bfloat16], rtol=0)
    out = run(q, k, v, 4)
    assert seen[-1] == (torch.bfloat16,) * 3 and out.dtype == torch.bfloat16
    q32, k32, v32 = _packed()
    assert run(q32, k32, v32, 4, upcast=True).dtype == torch.float32 and seen[-1] == (torch.float32,) * 3


def _single_head_reference(q, k, v):
    """softmax(QᵀK / sqrt(C)) over the spatial tokens, channels as the head dim, computed by hand."""
    batch, channels = q.shape[:2]
    qt, kt, vt = (t.reshape(batch, channels, -1).transpose(1, 2).double() for t in (q, k, v))  # [B, HW, C]
    weights = torch.softmax(qt @ kt.transpose(1, 2) / math.sqrt(channels), dim=-1)
    return (weights @ vt).transpose(1, 2).reshape(q.shape).float()


@pytest.mark.parametrize("spatial", [(6, 7), (3, 4, 5)], ids=["image", "video"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_channel_attention_is_one_head_over_the_spatial_tokens(name, spatial):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 32, *spatial, generator=g) for _ in range(3))
    out = A.channel_attention(backend_function(name, CONFIGS["tiny-budget"]))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _single_head_reference(q, k, v), atol=ATOL[torch.float32], rtol=0)


def test_channel_attention_through_the_per_signature_callable():
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 16, 5, 5, generator=g) for _ in range(3))
    attention = build_attention(AttentionConfig(backend="sliced", slice_size=7))
    out = A.channel_attention(attention)(q, k, v)
    (decision,) = attention.decisions
    assert decision.picked == "sliced" and decision.signature.startswith("q 1x1x25x16 ")
    torch.testing.assert_close(out, _single_head_reference(q, k, v), atol=ATOL[torch.float32], rtol=0)


# -- optim/ stays host-independent ------------------------------------------------------------------

OPTIM = Path(A.__file__).resolve().parent
FORBIDDEN_TOP = ("measure", "nodes", "tools", "server", "folder_paths", "execution", "main")


def _forbidden(module: str) -> bool:
    top = module.split(".")[0]
    return top.startswith("comfy") or top in FORBIDDEN_TOP or module.startswith(("sdopt.measure", "sdopt.nodes", "sdopt.tools"))


def _imports(tree: ast.AST):
    """(line, module name as it resolves from optim/) of every import, string module names of
    importlib.import_module/__import__ calls included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module
            elif node.level == 1:  # a sibling in optim/
                yield node.lineno, "sdopt.optim." + (node.module or "")
            else:  # the package root: ..measure, .. import nodes
                names = [node.module] if node.module else [alias.name for alias in node.names]
                yield from ((node.lineno, name) for name in names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def test_the_import_rule_sees_what_it_must_refuse():
    source = (
        "import comfy.model_management\nfrom comfy_execution import progress\nfrom ..measure.profiler import x\n"
        "from .. import nodes\nimport server\ndef f():\n    import folder_paths\n    importlib.import_module('measure.report')\n"
        "from . import precision\nfrom ..errors import UserError\nimport torch\n"
    )
    found = [name for _, name in _imports(ast.parse(source)) if _forbidden(name)]
    assert found == ["comfy.model_management", "comfy_execution", "measure.profiler", "nodes", "server", "folder_paths", "measure.report"]


def test_optim_never_imports_a_host_the_profiler_or_the_report():
    files = sorted(OPTIM.rglob("*.py"))
    assert {"attention.py", "attention_auto.py", "precision.py", "adapters.py"} <= {f.name for f in files}
    offending = [
        f"{path.relative_to(OPTIM)}:{line}: {name}"
        for path in files
        for line, name in _imports(ast.parse(path.read_text(), str(path)))
        if _forbidden(name)
    ]
    assert offending == []


def test_a_dynamic_compile_with_one_backend_serves_every_resolution():
    """With one backend picked for every shape so far, the compiled code does not look the shape
    up: a lookup would guard on it and a dynamic compile would recompile per resolution."""
    from sdopt.optim.compile import CompileConfig, compile_forward

    attention = A.build_attention(A.AttentionConfig(backend="sdpa"))

    def attend(_module, x):
        q = x.flatten(2).transpose(1, 2).unsqueeze(1)
        return attention(q, q, q)

    torch._dynamo.reset()
    fast = compile_forward(torch.nn.Identity(), attend, CompileConfig(backend="eager", dynamic=True))
    for size in (4, 6, 8):
        x = torch.randn(1, 8, size, size)
        fast(x)  # the first call of a shape runs eagerly and decides its backend
        torch.testing.assert_close(fast(x), attend(None, x))
    torch._dynamo.reset()
    assert fast.stats.compilations == 1, fast.stats.summary()
