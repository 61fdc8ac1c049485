"""Auto selection: wrong and quantizing backends turned down, the fastest by median, trials on a sample
of the query rows, one decision per signature, the pick's own output returned; the check against
naive and the timing."""
import math

import pytest
import torch

from sdopt.optim.attention import auto
from sdopt.optim.attention.auto import AUTO_REPEATS, AutoAttention, check_against_naive, time_attention
from sdopt.optim.attention.backends import AttentionConfig, Backend, Limits, backend_names, get_backend
from sdopt.optim.attention.config import ANY_DEVICE, AUTO, Tolerance
from sdopt.optim.attention.dispatch import build_attention
from sdopt.optim.attention.kernels import naive_attention
from sdopt.optim.attention.per_signature import summarize_decisions

from .support import ATOL, max_error, qkv, rows_seen


def _counting(name, fn, calls):
    def counted(q, k, v, mask=None):
        calls.append(name)
        return fn(q, k, v, mask)

    return Backend(name, counted, {ANY_DEVICE: Limits()})


def test_auto_rejects_a_wrong_backend_even_when_it_is_fastest(registered):
    calls = []
    registered(_counting("zeros", lambda q, k, v, mask=None: torch.zeros_like(q), calls))
    registered(_counting("raises", lambda q, k, v, mask=None: 1 / 0, calls))
    attention = AutoAttention(candidates=("zeros", "raises", "naive", "sdpa"))
    q, k, v = qkv(2, 2, 77, 77, 40)
    out = attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.requested == AUTO
    assert decision.picked in ("naive", "sdpa")
    assert set(decision.times_s) == {"naive", "sdpa"} and all(t > 0 for t in decision.times_s.values())
    assert "exceeds the float32 tolerance (atol 0.0001 + rtol 0.0001)" in decision.rejected["zeros"]
    assert decision.rejected["raises"].startswith("failed: ZeroDivisionError")
    assert max_error(out, q, k, v) <= ATOL[torch.float32]
    active, note = summarize_decisions(attention.decisions)
    assert active == decision.picked and "rejected: zeros (max abs error" in note


def test_auto_picks_the_fastest_by_median(registered, monkeypatch):
    """The timings are stubbed (unit tests never depend on real speed); the choice logic is not."""
    seconds = {"steady": [3.0, 3.0, 3.0], "spiky": [9.0, 1.0, 2.0], "slow": [5.0, 5.0, 5.0]}
    for name in seconds:
        registered(_counting(name, naive_attention, []))
    names_by_fn = {get_backend(name).fn: name for name in seconds}
    monkeypatch.setattr(auto, "time_attention", lambda fn, *args, **kwargs: seconds[names_by_fn[fn]])
    attention = AutoAttention(candidates=("slow", "steady", "spiky"))
    q, k, v = qkv(1, 2, 8, 8, 16)
    attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.times_s == {"slow": 5.0, "steady": 3.0, "spiky": 2.0}
    assert decision.picked == "spiky"


def test_auto_never_picks_a_quantizing_backend_even_when_it_is_exact_and_fastest(registered, monkeypatch):
    """The timings are stubbed: ``quantized`` is the fastest and its output is naive's, and it still
    is no candidate."""
    registered(Backend("quantized", naive_attention, {ANY_DEVICE: Limits()}, "8-bit QK stand-in", low_precision=True))
    monkeypatch.setattr(auto, "time_attention", lambda fn, *args, **kwargs: [0.1] if fn is naive_attention else [1.0])
    attention = AutoAttention(candidates=("quantized", "sdpa"))
    attention(*qkv(1, 2, 8, 8, 16))
    (decision,) = attention.decisions
    assert decision.picked == "sdpa" and set(decision.times_s) == {"sdpa"}
    assert decision.rejected["quantized"] == ("quantizes inside (8-bit QK stand-in); auto keeps exact backends, "
                                              "choose quantized by name to run it")


@pytest.mark.parametrize("free, tried", [(100_000, {"sdpa", "sub_quadratic"}), (10**9, {"naive", "sdpa_math", "sdpa", "sub_quadratic"})],
                         ids=["scores-past-half-free", "scores-fit"])
def test_auto_tries_a_backend_that_holds_the_scores_only_where_they_fit(monkeypatch, free, tried):
    """q, k [1, 2, 64, 16] fp32: naive's and sdpa_math's scores and softmax take 2 x 2 x 64 x 64 x 4 = 65,536 bytes."""
    monkeypatch.setattr(auto, "free_memory", lambda device: free)
    attention = AutoAttention(candidates=("naive", "sdpa_math", "sdpa", "sub_quadratic"))
    attention(*qkv(1, 2, 64, 64, 16))
    (decision,) = attention.decisions
    assert set(decision.times_s) == tried
    for name in {"naive", "sdpa_math"} - tried:
        assert decision.rejected[name] == "not tried: its query-by-key scores would take 0.1 MiB, more than 50% of the 0.1 MiB free on cpu"


def test_auto_computes_the_naive_reference_once_for_all_its_candidates(monkeypatch):
    """naive's output is the costliest part of a decision on a CPU: one per signature, not one per candidate."""
    references = []
    real = auto.naive_attention
    monkeypatch.setattr(auto, "naive_attention", lambda *args: references.append(1) or real(*args))
    attention = AutoAttention(candidates=("sdpa", "sliced", "sub_quadratic"), repeats=1)
    attention(*qkv(1, 2, 64, 64, 16))
    (decision,) = attention.decisions
    assert set(decision.times_s) == {"sdpa", "sliced", "sub_quadratic"}
    assert len(references) == 1, "one block of rows fits the budget, computed once"


def test_auto_times_a_long_sequence_on_rows_through_all_of_it_and_runs_its_pick_once_whole(registered, monkeypatch):
    """Past TRIAL_QUERY_ROWS each trial takes an even stride of the rows (all of the mask's part for
    them), and only the pick runs on every row before the decision stands."""
    monkeypatch.setattr(auto, "TRIAL_QUERY_ROWS", 16)
    seen = []
    registered(rows_seen("recorded", naive_attention, seen))
    q, k, v = qkv(1, 2, 64, 40, 16)
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
    monkeypatch.setattr(auto, "TRIAL_QUERY_ROWS", 16)

    def wrong_when_long(q, k, v, mask=None):
        out = naive_attention(q, k, v, mask)
        return out if q.shape[2] <= 16 else out + 1

    def raises_when_long(q, k, v, mask=None):
        if q.shape[2] > 16:
            raise RuntimeError("no kernel for this size")
        return naive_attention(q, k, v, mask)

    registered(Backend("wrong_when_long", wrong_when_long, {ANY_DEVICE: Limits()}))
    registered(Backend("raises_when_long", raises_when_long, {ANY_DEVICE: Limits()}))
    monkeypatch.setattr(auto, "time_attention", lambda fn, *args, **kwargs: {
        "wrong_when_long": [1.0], "raises_when_long": [2.0]}.get(fn.__name__, [3.0]))
    attention = AutoAttention(candidates=("wrong_when_long", "raises_when_long", "naive"))
    q, k, v = qkv(1, 2, 64, 40, 16)
    out = attention(q, k, v)
    (decision,) = attention.decisions
    assert decision.picked == "naive" and set(decision.times_s) == {"naive"}
    assert decision.rejected["wrong_when_long"].startswith("on all 64 query rows: max abs error 1.00e+00 vs naive exceeds")
    assert decision.rejected["raises_when_long"] == "failed on all 64 query rows: RuntimeError: no kernel for this size"
    assert torch.equal(out, naive_attention(q, k, v))


def test_auto_short_sequences_are_timed_whole_and_not_run_twice(registered):
    seen = []
    registered(rows_seen("recorded", naive_attention, seen))
    attention = AutoAttention(candidates=("recorded",), repeats=1)
    attention(*qkv(1, 2, auto.TRIAL_QUERY_ROWS, 40, 16))
    assert seen == [auto.TRIAL_QUERY_ROWS] * 2, "the check, whose output the call returns, and one timed call"
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
        registered(Backend(name, shifted, {ANY_DEVICE: Limits()}))
    monkeypatch.setattr(auto, "time_attention", lambda fn, *args, **kwargs: times[fn.__name__])
    attention = AutoAttention(candidates=("first", "second"))
    q, k, v = qkv(1, 2, 32, 40, 16)
    expected = naive_attention(q, k, v) + offsets[returned]
    assert torch.equal(attention(q, k, v), expected)
    assert attention.decisions[0].picked == returned
    assert torch.equal(attention(q, k, v), expected)


def test_auto_decides_once_per_signature(registered):
    calls = []
    registered(_counting("counted", naive_attention, calls))
    seen = []
    attention = AutoAttention(on_decision=seen.append, candidates=("counted", "sdpa"), repeats=2)
    q, k, v = qkv(1, 2, 40, 40, 16)
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
    q, k, v = qkv(1, 2, 16, 16, 8)
    attention(q, k, v)
    (decision,) = attention.decisions
    assert set(decision.times_s) | set(decision.rejected) == set(backend_names())
    assert decision.rejected["sdpa_efficient"] == "sdpa_efficient needs CUDA"


def test_check_against_naive_accepts_the_reference_and_names_the_tolerance():
    q, k, v = qkv(2, 2, 50, 30, 16)
    exact = check_against_naive(naive_attention(q, k, v), q, k, v)
    assert exact.ok and exact.max_abs_error == 0.0 and exact.reason == ""
    off = naive_attention(q, k, v)
    off[1, 1, -1, -1] += 1e-2  # the last row of the last block only
    check = check_against_naive(off, q, k, v, memory_budget_bytes=2 * 2 * 2 * 30 * 4 * 7)  # 7-row blocks
    assert not check.ok and check.max_abs_error == pytest.approx(1e-2, rel=1e-3)
    assert check.reason == "max abs error 1.00e-02 vs naive exceeds the float32 tolerance (atol 0.0001 + rtol 0.0001)"
    loose = check_against_naive(off, q, k, v, tolerance=Tolerance(atol=2e-2, rtol=0))
    assert loose.ok and loose.max_abs_error == pytest.approx(1e-2, rel=1e-3)


def test_check_against_naive_uses_the_dtype_tolerance():
    q, k, v = qkv(1, 2, 20, 20, 16, torch.bfloat16)
    out = naive_attention(q, k, v)
    assert check_against_naive(out, q, k, v).ok
    bad = (out.float() + 0.1).to(torch.bfloat16)
    check = check_against_naive(bad, q, k, v)
    assert not check.ok and "bfloat16 tolerance (atol 0.03 + rtol 0.03)" in check.reason


def test_check_against_naive_wrong_shape_and_nan():
    q, k, v = qkv(1, 2, 8, 8, 16)
    wrong = check_against_naive(torch.zeros(1, 2, 8, 15), q, k, v)
    assert not wrong.ok and wrong.max_abs_error == math.inf and wrong.reason == "output shape [1, 2, 8, 15] instead of [1, 2, 8, 16]"
    nan = naive_attention(q, k, v)
    nan[0, 0, 3, 0] = float("nan")
    check = check_against_naive(nan, q, k, v)
    assert not check.ok and check.max_abs_error == math.inf, "NaN where the reference is finite is wrong"


def test_check_against_naive_agrees_on_fully_masked_rows():
    q, k, v = qkv(1, 2, 6, 5, 8)
    keep = torch.ones(6, 5, dtype=torch.bool)
    keep[2] = False  # query 2 sees no key: naive gives NaN there
    reference = naive_attention(q, k, v, keep)
    assert reference[:, :, 2].isnan().all() and not reference[:, :, :2].isnan().any()
    assert check_against_naive(reference, q, k, v, keep).ok
    zeros = reference.nan_to_num()
    assert not check_against_naive(zeros, q, k, v, keep).ok, "a number where the reference has NaN is not agreement"


def test_time_attention_calls_each_repeat():
    calls = []
    q, k, v = qkv(1, 2, 8, 8, 16)
    mask = torch.zeros(8, 8)
    seconds = time_attention(lambda *args: calls.append(args), q, k, v, mask)
    assert AUTO_REPEATS == 3 and len(seconds) == AUTO_REPEATS == len(calls)
    assert all(s >= 0 for s in seconds) and all(c[3] is mask for c in calls)
    assert len(time_attention(naive_attention, q, k, v, repeats=5)) == 5
    assert AutoAttention().repeats == AUTO_REPEATS
