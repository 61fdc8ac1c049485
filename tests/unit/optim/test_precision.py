"""Precision on CPU: converted copies of a tiny diffusers UNet and a plain module, the plan, what
``auto`` picks (with the probe faked), weight memory, the TF32 scope, input errors, and the NaN
guard on a VAE that overflows in fp16."""
import copy

import subprocess
import sys

import pytest
import torch
from diffusers import AutoencoderKL
from torch import nn

from sdopt.errors import UserError
from sdopt.optim import precision as P
from sdopt.optim.precision import (
    BF16_FASTER_BELOW,
    PrecisionConfig,
    PrecisionPlan,
    check_compute_dtype,
    compute_supported,
    converted_copy,
    dtype_name,
    has_nonfinite,
    parse_dtype,
    pick_dtype,
    plan_precision,
    run_with_nan_guard,
    safe_dtype,
    tf32_scope,
    weight_bytes,
)

# Relative L2 error of the tiny UNet's output with bf16 weights computing in bf16, against fp32.
# bf16 keeps 8 mantissa bits (relative step 2^-8 = 3.9e-3 per rounding); measured about 5e-3 here.
BF16_REL_TOL = 3e-2
# fp32 channels-last vs contiguous: other conv kernels, same math.
CHANNELS_LAST_TOL = 1e-5
# The NaN guard's bf16 redo of the overflowing VAE, against its fp32 decode.
GUARD_TOL = 3e-2
FP16_OVERFLOW_SCALE = 1e5  # decoder.conv_in outputs reach ~1.6e5, past fp16's 65504
HALF = [dt for dt in (torch.float16, torch.bfloat16) if compute_supported(dt, "cpu")]


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture()
def unet(tiny_unet):
    return tiny_unet


@pytest.fixture(scope="module")
def unet_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 500]), torch.randn(2, 5, 32, generator=g)


def run_unet(unet, inputs, dtype=torch.float32):
    x, t, ctx = inputs
    with torch.no_grad():
        return unet(x.to(dtype), t, ctx.to(dtype)).sample


class Plain(nn.Module):
    """Floating parameters of every rank, a floating 4-D buffer, an integer buffer, a tied weight
    and a plain tensor attribute."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.linear = nn.Linear(16, 8)
        self.tied = nn.Linear(16, 8)
        self.tied.weight = self.linear.weight
        self.register_buffer("kernel", torch.randn(2, 4, 3, 3))
        self.register_buffer("counter", torch.arange(5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return self.linear(self.norm(self.conv(x)).mean((2, 3)))


@pytest.fixture
def plain():
    torch.manual_seed(2)
    return Plain().eval()


def _snapshot(module):
    return {name: (t.clone(), t.dtype, t.stride()) for name, t in module.state_dict(keep_vars=True).items()}


def _assert_unchanged(module, snapshot):
    now = module.state_dict(keep_vars=True)
    assert now.keys() == snapshot.keys()
    for name, (value, dtype, stride) in snapshot.items():
        assert now[name].dtype == dtype and now[name].stride() == stride, name
        assert torch.equal(now[name], value), name


# -- converted copies --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=dtype_name)
def test_converted_copy_converts_floating_tensors_only(plain, dtype):
    snapshot = _snapshot(plain)
    originals = dict(plain.named_parameters())
    copied = converted_copy(plain, dtype)
    _assert_unchanged(plain, snapshot)
    assert all(plain.get_parameter(n) is p for n, p in originals.items()), "the original keeps its own Parameters"
    assert {p.dtype for p in copied.parameters()} == {dtype}
    assert all(isinstance(p, nn.Parameter) for p in copied.parameters())
    assert copied.kernel.dtype == dtype
    assert copied.counter.dtype == torch.int64 and torch.equal(copied.counter, plain.counter)
    assert copied.tied.weight is copied.linear.weight, "tied weights stay tied in the copy"
    assert plain.conv.weight.requires_grad and not any(p.requires_grad for p in copied.parameters()), "inference copies, as ComfyUI patches them"
    expected = plain.conv.weight.detach().to(dtype)
    assert torch.equal(copied.conv.weight.detach().view(torch.uint8), expected.view(torch.uint8)), "a plain cast"
    assert weight_bytes(copied) == weight_bytes(plain, dtype)


def test_converted_copy_channels_last_applies_to_4d_tensors_only(plain):
    copied = converted_copy(plain, torch.float16, channels_last=True)
    assert copied.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not copied.conv.weight.is_contiguous()
    assert copied.kernel.is_contiguous(memory_format=torch.channels_last) and not copied.kernel.is_contiguous()
    assert copied.linear.weight.is_contiguous() and copied.norm.weight.is_contiguous()
    assert plain.conv.weight.is_contiguous() and plain.kernel.is_contiguous(), "the original stays NCHW"
    assert converted_copy(plain, torch.float16).conv.weight.is_contiguous(), "channels-last only when asked"


def test_converted_copy_changes_nothing_in_the_original_when_the_copy_is_changed(plain):
    copied = converted_copy(plain, torch.float16)
    snapshot = _snapshot(plain)
    with torch.no_grad():
        for p in copied.parameters():
            p.add_(1)
        copied.kernel.add_(1)
    copied.linear = nn.Identity()
    _assert_unchanged(plain, snapshot)
    assert isinstance(plain.linear, nn.Linear)


def test_converted_copy_to_the_same_dtype_shares_no_storage(plain):
    copied = converted_copy(plain, torch.float32)
    snapshot = _snapshot(plain)
    with torch.no_grad():
        copied.conv.weight.add_(1)
        copied.kernel.add_(1)
    _assert_unchanged(plain, snapshot)


class Unpicklable:
    """A handle deepcopy refuses, as a memory manager's native slot is."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy a native handle")


def test_converted_copy_leaves_out_host_state_without_copying_or_sharing_it(plain):
    handle, pinned = Unpicklable(), {"weight": torch.zeros(4)}
    plain.conv.slot, plain.conv.pins, plain.conv.staged = handle, pinned, True
    plain.linear.slot = Unpicklable()
    with pytest.raises(TypeError, match="native handle"):
        converted_copy(plain, torch.float16)
    type(plain.conv).staged = False  # a class default, which the copy shows again
    try:
        copied = converted_copy(plain, torch.float16, leave_out=("slot", "pins", "staged", "absent"))
        assert not hasattr(copied.conv, "slot") and not hasattr(copied.conv, "pins") and not hasattr(copied.linear, "slot")
        assert copied.conv.staged is False and plain.conv.staged is True
    finally:
        del type(plain.conv).staged
    assert plain.conv.slot is handle and plain.conv.pins is pinned, "the original keeps its state"
    assert copied.training is plain.training and copied.conv.padding == plain.conv.padding, "shared atoms are untouched"


def test_converted_copy_does_not_record_autograd(plain):
    copied = converted_copy(plain, torch.bfloat16)
    assert all(p.is_leaf and p.grad_fn is None for p in copied.parameters())


def test_converted_unet_fp32_copy_runs_exactly_like_the_original(unet, unet_inputs):
    ref = run_unet(unet, unet_inputs)
    snapshot = _snapshot(unet)
    copied = converted_copy(unet, torch.float32)
    assert copied is not unet and copied.conv_in is not unet.conv_in
    assert torch.equal(run_unet(copied, unet_inputs), ref)
    _assert_unchanged(unet, snapshot)


def test_converted_unet_channels_last_matches_eager(unet, unet_inputs):
    ref = run_unet(unet, unet_inputs)
    copied = converted_copy(unet, torch.float32, channels_last=True)
    assert copied.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(run_unet(copied, unet_inputs), ref) < CHANNELS_LAST_TOL
    assert torch.equal(run_unet(unet, unet_inputs), ref)


def test_converted_unet_bf16_copy_stays_close(unet, unet_inputs):
    if torch.bfloat16 not in HALF:
        pytest.skip("this CPU does not compute in bf16")
    ref = run_unet(unet, unet_inputs)
    snapshot = _snapshot(unet)
    copied = converted_copy(unet, torch.bfloat16)
    assert {p.dtype for p in copied.parameters()} == {torch.bfloat16}
    out = run_unet(copied, unet_inputs, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert 0 < rel_err(out, ref) < BF16_REL_TOL, "bf16 weights change the output a little"
    _assert_unchanged(unet, snapshot)
    assert torch.equal(run_unet(unet, unet_inputs), ref), "the original is bit-identical after the copy ran"


def test_weight_bytes_figures(plain):
    params = list(plain.parameters())  # the tied weight counts once
    n = sum(p.numel() for p in params)
    assert weight_bytes(plain) == 4 * n
    assert weight_bytes(plain, torch.float16) == 2 * n
    assert weight_bytes(plain, torch.float8_e4m3fn) == n
    assert weight_bytes(plain.half()) == 2 * n


# -- the plan ----------------------------------------------------------------------------------


def test_plan_keeps_compute_for_fp8_and_follows_half_weights():
    keep = plan_precision(PrecisionConfig(weight_dtype="fp8_e5m2"), torch.float32, torch.float32, "cpu")
    assert (keep.weight_dtype, keep.compute_dtype, keep.upcasts) == (torch.float8_e5m2, torch.float32, True)
    nothing = plan_precision(PrecisionConfig(), torch.float16, torch.float32, "cpu")
    assert (nothing.weight_dtype, nothing.compute_dtype, nothing.upcasts) == (torch.float16, torch.float32, True)
    for name in ("fp16", "bf16"):
        dtype = P.DTYPES[name]
        if dtype in HALF:
            half = plan_precision(PrecisionConfig(weight_dtype=name), torch.float32, torch.float32, "cpu")
            assert half.compute_dtype == dtype and not half.upcasts


def test_plan_with_an_explicit_compute_dtype():
    if torch.bfloat16 not in HALF:
        pytest.skip("this CPU does not compute in bf16")
    plan = plan_precision(PrecisionConfig("fp8_e4m3fn", "bf16", tf32=True, channels_last=True), torch.float16, torch.float16, "cpu")
    assert plan == PrecisionPlan(torch.float8_e4m3fn, torch.bfloat16, True, True)
    assert plan.upcasts
    same = plan_precision(PrecisionConfig(compute_dtype="fp32"), torch.float32, torch.bfloat16, "cpu")
    assert (same.weight_dtype, same.compute_dtype, same.upcasts) == (torch.float32, torch.float32, False)


def test_plan_on_a_device_without_the_dtypes():
    # The meta device never yields a finite result, so every reduced dtype fails its probe there.
    weights = plan_precision(PrecisionConfig(weight_dtype="bf16"), torch.float32, torch.float32, "meta")
    assert (weights.weight_dtype, weights.compute_dtype) == (torch.bfloat16, torch.float32), "keeps computing as now"
    computing = plan_precision(PrecisionConfig(), torch.float16, torch.float16, "meta")
    assert computing.compute_dtype == torch.float32, "a compute dtype the device cannot run becomes fp32"


def test_configs_are_frozen_and_checked():
    config = PrecisionConfig(weight_dtype="fp16")
    with pytest.raises(AttributeError):
        config.weight_dtype = "bf16"
    assert PrecisionConfig() == PrecisionConfig(None, None, False, False)


# -- what auto picks -----------------------------------------------------------------------------


@pytest.fixture
def probe_cache():
    """The measured ratio is cached per device: start and end every test with an empty cache."""
    measured = P._bf16_over_fp32  # the real, cached function, even while a test replaces it
    measured.cache_clear()
    yield
    measured.cache_clear()


@pytest.fixture
def bf16_runs(monkeypatch):
    real = P.compute_supported
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: dtype == torch.bfloat16 or real(dtype, device))


def test_auto_picks_bf16_where_it_measured_faster(monkeypatch, probe_cache, bf16_runs):
    asked = []
    monkeypatch.setattr(P, "_bf16_over_fp32", lambda device: asked.append(device) or 0.5)
    pick = pick_dtype("cpu")
    assert pick.dtype == torch.bfloat16 and asked == ["cpu"]
    assert "0.50x" in pick.reason and "bf16" in pick.reason and "fp32" in pick.reason
    assert not pick.reason.endswith("so fp32")


@pytest.mark.parametrize("ratio", [2.0, BF16_FASTER_BELOW])
def test_auto_keeps_fp32_where_bf16_is_not_clearly_faster(monkeypatch, probe_cache, bf16_runs, ratio):
    monkeypatch.setattr(P, "_bf16_over_fp32", lambda device: ratio)
    pick = pick_dtype(torch.device("cpu"))
    assert pick.dtype == torch.float32
    assert f"{ratio:.2f}x" in pick.reason and pick.reason.endswith(", so fp32")


def test_auto_without_bf16_does_not_probe(monkeypatch, probe_cache):
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: dtype == torch.float32)
    monkeypatch.setattr(P, "_bf16_over_fp32", lambda device: pytest.fail("no probe where bf16 does not run"))
    pick = pick_dtype("cpu")
    assert pick.dtype == torch.float32 and pick.reason == "bf16 does not run on cpu"


@pytest.mark.parametrize("fp16_runs", [True, False])
def test_auto_on_cuda_is_fp16_where_it_runs(monkeypatch, probe_cache, fp16_runs):
    asked = []
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: asked.append((dtype, str(device))) or fp16_runs)
    monkeypatch.setattr(P, "_bf16_over_fp32", lambda device: pytest.fail("CUDA is not probed"))
    pick = pick_dtype("cuda:1")
    if fp16_runs:
        assert asked == [(torch.float16, "cuda:1")]
        assert pick.dtype == torch.float16 and pick.reason.startswith("fp16 on CUDA")
    else:
        assert asked == [(torch.float16, "cuda:1"), (torch.bfloat16, "cuda:1")]
        assert pick.dtype == torch.float32 and pick.reason == "fp16 or bf16 does not run on cuda:1"


@pytest.mark.parametrize("bf16_runs_there", [True, False])
def test_auto_on_cuda_follows_the_model_that_prefers_bf16(monkeypatch, probe_cache, bf16_runs_there):
    """Flux's ComfyUI config lists bf16 first: its activations overflow fp16 on real weights."""
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: dtype != torch.bfloat16 or bf16_runs_there)
    pick = pick_dtype("cuda", (torch.bfloat16, torch.float16, torch.float32))
    if bf16_runs_there:
        assert pick.dtype == torch.bfloat16 and "this model prefers" in pick.reason
    else:
        assert pick.dtype == torch.float16 and "bf16, which this model prefers, does not run on cuda" in pick.reason


def test_auto_never_picks_a_dtype_the_model_does_not_run_in(monkeypatch, probe_cache, bf16_runs):
    monkeypatch.setattr(P, "_bf16_over_fp32", lambda device: pytest.fail("no probe for a model without bf16"))
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: True)
    assert pick_dtype("cuda", (torch.bfloat16, torch.float32)).dtype == torch.bfloat16
    assert pick_dtype("cpu", (torch.float16, torch.float32)).dtype == torch.float32
    only_fp32 = pick_dtype("cuda", (torch.float32,))
    assert only_fp32.dtype == torch.float32 and only_fp32.reason == "this model runs in fp32 only"


def _fake_probe(monkeypatch, fp32_s, bf16_s):
    """``_probe_once`` answering fixed seconds for fp32 and the given bf16 ones in order, counting calls."""
    calls = []
    bf16_times = iter(bf16_s)

    def probe(device, dtype, side=32):
        calls.append((device.type, dtype, side))
        return fp32_s if dtype == torch.float32 else next(bf16_times)

    monkeypatch.setattr(P, "_probe_once", probe)
    return calls


def test_probe_stops_after_the_small_probe_when_bf16_is_far_slower(monkeypatch, probe_cache):
    calls = _fake_probe(monkeypatch, 1.0, [25.0])
    assert P._bf16_over_fp32("cpu") == 25.0
    assert calls == [("cpu", torch.float32, 8)] * 2 + [("cpu", torch.bfloat16, 8)], "a warm-up and one fp32, one bf16"
    assert P._bf16_over_fp32("cpu") == 25.0 and len(calls) == 3, "measured once per device"


def test_probe_takes_the_fastest_of_five_interleaved_full_size_rounds(monkeypatch, probe_cache):
    calls = _fake_probe(monkeypatch, 2.0, [3.0, 4.0, 3.0, 1.0, 0.5, 9.0, 1.5])
    assert P._bf16_over_fp32("cpu") == 0.25  # min(3.0, 1.0, 0.5, 9.0, 1.5) / 2.0; the small probe and the 4.0 warm-up do not count
    full = [(dtype, side) for _, dtype, side in calls if side == 32]
    assert full == [(torch.float32, 32), (torch.bfloat16, 32)] + [(torch.float32, 32), (torch.bfloat16, 32)] * 5


def test_probe_really_runs_on_cpu():
    seconds = P._probe_once(torch.device("cpu"), torch.float32)
    assert 0 < seconds < 10


# -- dtype names and support --------------------------------------------------------------------


def test_dtype_names():
    assert [dtype_name(P.DTYPES[n]) for n in P.WEIGHT_DTYPES] == list(P.WEIGHT_DTYPES)
    assert dtype_name(torch.float64) == "float64"
    assert parse_dtype("bf16", "dtype", P.COMPUTE_DTYPES) == torch.bfloat16


def test_safe_dtype_order(monkeypatch):
    assert safe_dtype(torch.float32, "cpu") is None
    assert safe_dtype(torch.bfloat16, "cpu") == torch.float32
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: True)
    assert safe_dtype(torch.float16, "cpu") == torch.bfloat16
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: dtype == torch.float32)
    assert safe_dtype(torch.float16, "cpu") == torch.float32


def test_has_nonfinite_looks_into_containers():
    assert not has_nonfinite({"a": [torch.ones(2), (torch.zeros(1),)], "b": "text"})
    assert has_nonfinite({"a": [torch.ones(2), (torch.tensor([float("inf")]),)]})
    assert not has_nonfinite(torch.tensor([1, 2]))


# -- channels-last and TF32 -----------------------------------------------------------


def _flags():
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


@pytest.fixture(autouse=True)
def _process_tf32_settings():
    """Put every TF32 setting back exactly (per backend too) after each test, so that tests which set
    them through the legacy API leave no mix of old and new settings, which torch refuses to read."""
    knobs = [torch.backends] + [getattr(torch.backends, name) for name in ("cuda", "cudnn", "mkldnn")]
    knobs += [getattr(k, sub) for k in knobs[1:] for sub in ("matmul", "conv", "rnn") if hasattr(k, sub)]
    saved = [(k, k.fp32_precision) for k in knobs if hasattr(k, "fp32_precision")]
    yield
    for knob, value in saved:
        knob.fp32_precision = value


def test_tf32_scope_sets_and_restores_even_on_exception():
    before = _flags()
    with pytest.raises(ZeroDivisionError):
        with tf32_scope():
            assert _flags() == (True, True, "high")
            1 / 0
    assert _flags() == before
    with tf32_scope(False):
        assert _flags() == (False, False, "highest")
    assert _flags() == before


def test_tf32_scope_restores_a_non_default_precision():
    before = _flags()
    torch.set_float32_matmul_precision("medium")
    try:
        medium = _flags()
        with tf32_scope():
            pass
        assert _flags() == medium
    finally:
        torch.set_float32_matmul_precision(before[2])
    assert _flags() == before


def test_tf32_scope_restores_per_backend_settings():
    if not hasattr(torch.backends.mkldnn.matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend fp32_precision settings")
    # In a child process: once both the legacy and the per-backend API have set TF32, torch refuses
    # to read the legacy flags for the rest of the process, which would break later tests.
    code = """
import torch
from sdopt.optim.precision import tf32_scope
knobs = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.mkldnn.matmul)
torch.backends.mkldnn.matmul.fp32_precision = "bf16"
before = [k.fp32_precision for k in knobs]
with tf32_scope():
    assert [k.fp32_precision for k in knobs][:2] == ["tf32", "tf32"]
assert [k.fp32_precision for k in knobs] == before, ([k.fp32_precision for k in knobs], before)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- bad inputs ------------------------------------------------------------------------


def test_fp8_compute_dtype_is_refused_naming_the_input():
    with pytest.raises(UserError, match=r"^compute_dtype: fp8_e4m3fn is a storage format"):
        PrecisionConfig(compute_dtype="fp8_e4m3fn")
    with pytest.raises(UserError, match=r"^dtype: fp8_e5m2 is a storage format"):
        check_compute_dtype(torch.float8_e5m2, "cpu", "dtype")


def test_dtype_name_not_offered():
    with pytest.raises(UserError, match=r"^weight_dtype: 'fp64' is not offered; choose one of fp32, fp16"):
        PrecisionConfig(weight_dtype="fp64")
    with pytest.raises(UserError, match=r"^compute_dtype: 'half' is not offered"):
        parse_dtype("half", "compute_dtype", ("fp32", "fp16", "bf16"))


def test_compute_dtype_the_device_cannot_run_is_refused():
    # The meta device never yields a finite result, so every reduced dtype fails its probe there.
    assert compute_supported(torch.float32, "meta")
    assert not compute_supported(torch.float16, "meta")
    with pytest.raises(UserError, match=r"^compute_dtype: fp16 does not run on meta"):
        plan_precision(PrecisionConfig(compute_dtype="fp16"), torch.float32, torch.float32, "meta")


# -- NaN guard --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overflowing_vae():
    """A tiny VAE whose decoder overflows fp16 but not bf16/fp32 (GroupNorm then rescales it)."""
    torch.manual_seed(3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=32,
    ).eval()
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(FP16_OVERFLOW_SCALE)
        vae.decoder.conv_in.bias.mul_(FP16_OVERFLOW_SCALE)
    return vae


def _decoder_in(vae, dtype):
    cast = copy.deepcopy(vae)
    for p in cast.parameters():  # AutoencoderKL.to(dtype) warns; cast the tensors directly
        p.data = p.data.to(dtype)

    def decode(z):
        with torch.no_grad():
            return cast.decode(z.to(dtype)).sample

    return decode


def test_nan_guard_redoes_an_overflowing_fp16_decode(overflowing_vae):
    if torch.float16 not in HALF:
        pytest.skip("this CPU does not compute in fp16")
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    ref = _decoder_in(overflowing_vae, torch.float32)(z)
    assert torch.isfinite(ref).all()
    fp16 = _decoder_in(overflowing_vae, torch.float16)

    unguarded = fp16(z)
    assert has_nonfinite(unguarded), "without the guard the fp16 decode has NaN/Inf"

    asked = []

    def rerun_in(dtype):
        asked.append(dtype)
        return _decoder_in(overflowing_vae, dtype)(z)

    result = run_with_nan_guard(lambda: fp16(z), rerun_in, torch.float16, "cpu")
    expected = safe_dtype(torch.float16, "cpu")
    assert asked == [expected] and result.redone_in == (expected,)
    assert result.redone and result.finite and result.dtype == torch.float16
    assert torch.isfinite(result.output).all()
    assert rel_err(result.output, ref) < GUARD_TOL
    assert result.describe() == f"NaN/Inf in fp16; redone in {'bf16' if expected == torch.bfloat16 else 'fp32'}"


def test_nan_guard_leaves_a_finite_output_alone():
    calls = []
    result = run_with_nan_guard(lambda: {"sample": torch.ones(2)}, calls.append, torch.float16, "cpu")
    assert calls == [] and not result.redone and result.finite
    assert result.describe() == "finite in fp16"


def test_nan_guard_escalates_to_fp32_and_stops_there():
    nan = torch.tensor([float("nan")])
    asked = []

    def rerun_in(dtype):
        asked.append(dtype)
        return nan

    result = run_with_nan_guard(lambda: (nan,), rerun_in, torch.float16, "cpu")
    assert asked[-1] == torch.float32 and len(asked) == (2 if torch.bfloat16 in HALF else 1)
    assert not result.finite and result.describe().endswith("redone in fp32, still NaN/Inf")
    assert safe_dtype(torch.float32, "cpu") is None
    assert safe_dtype(torch.bfloat16, "cpu") == torch.float32


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 77, 154])
def test_fp8_linear_multiplies_in_fp8_within_e4m3s_rounding(rows):
    """Measured here: 3.8% relative L2 error against fp32 for (154 x 768) @ (768 x 320), of which
    2.7% is the weight's e4m3 rounding alone; the bound leaves room for other shapes and seeds."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 768, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(320, 768, generator=generator) * 0.05).to(torch.float8_e4m3fn)
    bias = torch.randn(320, generator=generator)
    out = P.fp8_linear(x, weight, bias, torch.bfloat16)
    reference = x.float() @ weight.float().T + bias
    assert out.shape == (2, rows, 320) and out.dtype == torch.bfloat16
    assert _rel(out, reference) < 0.06


def test_fp8_linear_keeps_activations_past_e4m3s_range():
    """An activation channel far past 448 (a DiT's massive activations) is scaled, not clamped."""
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    x[:, 0] = 3000.0
    weight = torch.eye(32).to(torch.float8_e4m3fn)
    out = P.fp8_linear(x, weight, None, torch.bfloat16)
    assert _rel(out, x) < 0.05 and out[:, 0].float().mean() > 2500


def test_fp8_linear_declines_widths_scaled_mm_cannot_take():
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    assert P.fp8_linear(x, torch.randn(16, 24).to(torch.float8_e4m3fn), None, torch.bfloat16) is None
    assert P.fp8_linear(torch.randn(4, 32), torch.randn(8, 32).to(torch.float8_e4m3fn), None, torch.bfloat16) is None


def test_fp8_matmul_needs_e4m3_weights_and_a_device_that_multiplies_fp8(monkeypatch):
    with pytest.raises(UserError, match="compute_dtype: fp8_matmul multiplies fp8_e4m3fn weights, and these are bf16"):
        plan_precision(PrecisionConfig("bf16", "fp8_matmul"), torch.float32, torch.float32, "cpu")
    monkeypatch.setattr(P, "fp8_matmul_supported", lambda device: False)
    with pytest.raises(UserError, match=r"compute_dtype: fp8_matmul: torch._scaled_mm does not run on cuda:0 .* choose bf16 or fp16"):
        plan_precision(PrecisionConfig("fp8_e4m3fn", "fp8_matmul"), torch.float32, torch.float32, "cuda:0")
    monkeypatch.setattr(P, "fp8_matmul_supported", lambda device: True)
    monkeypatch.setattr(P, "compute_supported", lambda dtype, device: dtype != torch.bfloat16)
    plan = plan_precision(PrecisionConfig("fp8_e4m3fn", "fp8_matmul"), torch.float32, torch.float32, "cuda:0")
    assert plan.fp8_matmul and plan.weight_dtype == torch.float8_e4m3fn and plan.compute_dtype == torch.float16
    assert plan_precision(PrecisionConfig("fp8_e4m3fn", "fp8_matmul"), torch.float32, torch.float32, "cpu").compute_dtype == torch.float32


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_on_a_cpu_gives_scaled_mms_own_numbers_eager_and_compiled(bias):
    """On a CPU the product is torch._scaled_mm's fp32 emulation written out (oneDNN's fp8 kernel on an
    AMX CPU is a reference kernel hundreds of times slower): equal to the bit to _scaled_mm with oneDNN
    off, where torch emulates it, and the same inside a compiled graph."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 48, 64, generator=generator).to(torch.bfloat16) * 40
    weight = torch.randn(32, 64, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(32, generator=generator) if bias else None
    out = P.fp8_linear(x, weight, b, torch.bfloat16)
    rows = x.reshape(-1, 64)
    scale = rows.abs().amax().float() / P.E4M3_MAX
    with torch.backends.mkldnn.flags(enabled=False):
        reference = torch._scaled_mm((rows.float() / scale).to(torch.float8_e4m3fn), weight.t(), scale_a=scale,
                                     scale_b=torch.ones(()), out_dtype=torch.bfloat16,
                                     bias=None if b is None else b.to(torch.bfloat16))
    assert torch.equal(out, reference.reshape(3, 48, 32))
    assert torch.equal(torch.compile(P.fp8_linear, backend="aot_eager", fullgraph=True)(x, weight, b, torch.bfloat16), out)
    assert P.fp8_matmul_kernel("cpu").startswith("torch._scaled_mm's fp32 emulation") and P.fp8_matmul_kernel("cuda:0") == "torch._scaled_mm"
