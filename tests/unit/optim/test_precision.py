"""Precision on CPU: storage/compute dtypes on a tiny diffusers UNet and a plain module,
weight memory, TF32 scope, channels-last, input errors, and the NaN guard on a VAE
that overflows in fp16."""
import copy

import pytest
import torch
from diffusers import AutoencoderKL
from torch import nn
from torch.nn.utils import parametrize

from sdopt.errors import UserError
from sdopt.optim.precision import (
    PrecisionConfig,
    apply_precision_,
    check_compute_dtype,
    compute_supported,
    converted_copy,
    has_nonfinite,
    parse_dtype,
    plan_precision,
    run_with_nan_guard,
    safe_dtype,
    tf32_scope,
    weight_bytes,
)

# Relative L2 error of the output against the fp32 module, per weight storage dtype.
# fp8 keeps 3 (e4m3fn) or 2 (e5m2) mantissa bits, and the small random-init weights are
# partly subnormal there, so its errors are an order of magnitude above bf16's.
REL_TOL = {"fp16": 5e-3, "bf16": 3e-2, "fp8_e4m3fn": 0.2, "fp8_e5m2": 0.3}
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
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.linear = nn.Linear(16, 8)

    def forward(self, x):
        return self.linear(self.norm(self.conv(x)).mean((2, 3)))


@pytest.fixture
def plain():
    torch.manual_seed(2)
    return Plain().eval()


def _matrix_weights(module):
    """The stored tensors behind every Linear/Conv weight (parametrized or not)."""
    found = {}
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.Conv2d)):
            found[name] = sub.parametrizations.weight.original if parametrize.is_parametrized(sub, "weight") else sub.weight
    return found


# -- storage and compute dtypes -------------------------------------------------------


@pytest.mark.parametrize("weight", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
def test_unet_storage_dtype_stores_weights_and_stays_close(unet, unet_inputs, weight):
    ref = run_unet(unet, unet_inputs)
    patched = copy.deepcopy(unet)
    result = apply_precision_(patched, PrecisionConfig(weight_dtype=weight))
    dtype = result.plan.weight_dtype
    compute = result.plan.compute_dtype
    assert compute == (dtype if dtype.itemsize == 2 and dtype in HALF else torch.float32)

    stored = _matrix_weights(patched)
    assert stored and all(w.dtype == dtype for w in stored.values())
    out = run_unet(patched, unet_inputs, compute)
    assert out.dtype == compute and torch.isfinite(out).all()
    assert rel_err(out, ref) < REL_TOL[weight]
    assert rel_err(out, ref) > 0, "a changed storage dtype must change the output a little"

    before = weight_bytes(unet)
    assert result.weight_bytes_before == before == 4 * sum(p.numel() for p in unet.parameters())
    assert result.weight_bytes_after == weight_bytes(patched)
    # Matrices hold nearly all the weights, so the saving is close to the all-in-dtype figure.
    ideal = before - weight_bytes(unet, dtype)
    assert 0.97 * ideal < result.saved_bytes <= ideal


def test_fp8_storage_with_bf16_compute(unet, unet_inputs):
    if torch.bfloat16 not in HALF:
        pytest.skip("this CPU does not compute in bf16")
    ref = run_unet(unet, unet_inputs)
    patched = copy.deepcopy(unet)
    result = apply_precision_(patched, PrecisionConfig(weight_dtype="fp8_e4m3fn", compute_dtype="bf16"))
    assert result.plan.upcasts and result.plan.compute_dtype == torch.bfloat16
    assert patched.conv_in.weight.dtype == torch.bfloat16, "read through the parametrization in compute dtype"
    assert patched.conv_in.parametrizations.weight.original.dtype == torch.float8_e4m3fn
    assert patched.conv_in.bias.dtype == torch.bfloat16, "biases and norms stay in the compute dtype"
    out = run_unet(patched, unet_inputs, torch.bfloat16)
    assert rel_err(out, ref) < REL_TOL["fp8_e4m3fn"]


def test_plain_module_fp16_storage_fp32_compute(plain):
    x = torch.randn(3, 4, 6, 6)
    ref = plain(x)
    patched = copy.deepcopy(plain)
    result = apply_precision_(patched, PrecisionConfig(weight_dtype="fp16", compute_dtype="fp32"))
    assert result.plan.upcasts
    assert {w.dtype for w in _matrix_weights(patched).values()} == {torch.float16}
    assert patched.norm.weight.dtype == torch.float32
    out = patched(x)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < REL_TOL["fp16"]
    assert result.saved_bytes == 2 * (plain.conv.weight.numel() + plain.linear.weight.numel())


@pytest.mark.parametrize("weight", ["fp16", "bf16", "fp8_e4m3fn"])
def test_plain_module_storage(plain, weight):
    x = torch.randn(3, 4, 6, 6)
    ref = plain(x)
    patched = copy.deepcopy(plain)
    result = apply_precision_(patched, PrecisionConfig(weight_dtype=weight))
    out = patched(x.to(result.plan.compute_dtype))
    assert {w.dtype for w in _matrix_weights(patched).values()} == {result.plan.weight_dtype}
    assert rel_err(out, ref) < REL_TOL[weight]


def test_original_is_bit_identical_after_a_patched_copy_ran(unet, unet_inputs):
    before = run_unet(unet, unet_inputs)
    weights = {k: v.clone() for k, v in unet.state_dict().items()}
    for config in (
        PrecisionConfig(weight_dtype="fp8_e4m3fn", tf32=True, channels_last=True),
        PrecisionConfig(weight_dtype="bf16"),
    ):
        patched = copy.deepcopy(unet)
        result = apply_precision_(patched, config)
        with result.scope():
            run_unet(patched, unet_inputs, result.plan.compute_dtype)
    after = run_unet(unet, unet_inputs)
    assert torch.equal(before, after)
    assert all(torch.equal(weights[k], v) and v.dtype == weights[k].dtype for k, v in unet.state_dict().items())
    assert not any(parametrize.is_parametrized(m) for m in unet.modules())


def test_converted_copy_leaves_the_original_and_converts_while_copying(unet, unet_inputs):
    ref = run_unet(unet, unet_inputs)
    marker = object()
    unet.sdopt_back_reference = marker
    try:
        copied = converted_copy(unet, torch.float8_e5m2, part=unet.down_blocks, channels_last=True, memo={id(marker): None})
    finally:
        del unet.sdopt_back_reference
    assert copied.sdopt_back_reference is None
    assert all(p.dtype == torch.float8_e5m2 for p in copied.down_blocks.parameters())
    assert all(p.dtype == torch.float32 for p in copied.up_blocks.parameters())
    conv = copied.down_blocks[0].resnets[0].conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == torch.float32 for p in unet.parameters())
    assert torch.equal(run_unet(unet, unet_inputs), ref)


def test_weight_bytes_figures(plain):
    n = sum(p.numel() for p in plain.parameters())
    assert weight_bytes(plain) == 4 * n
    assert weight_bytes(plain, torch.float16) == 2 * n
    assert weight_bytes(plain, torch.float8_e4m3fn) == n
    assert weight_bytes(plain.half()) == 2 * n


def test_plan_keeps_compute_for_fp8_and_follows_half_weights():
    keep = plan_precision(PrecisionConfig(weight_dtype="fp8_e5m2"), torch.float32, torch.float32, "cpu")
    assert (keep.weight_dtype, keep.compute_dtype) == (torch.float8_e5m2, torch.float32)
    nothing = plan_precision(PrecisionConfig(), torch.float16, torch.float32, "cpu")
    assert (nothing.weight_dtype, nothing.compute_dtype, nothing.upcasts) == (torch.float16, torch.float32, True)
    if torch.float16 in HALF:
        half = plan_precision(PrecisionConfig(weight_dtype="fp16"), torch.float32, torch.float32, "cpu")
        assert half.compute_dtype == torch.float16 and not half.upcasts


# -- channels-last and TF32 -----------------------------------------------------------


def test_channels_last_matches_eager(unet, unet_inputs):
    ref = run_unet(unet, unet_inputs)
    patched = copy.deepcopy(unet)
    apply_precision_(patched, PrecisionConfig(channels_last=True))
    assert patched.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(run_unet(patched, unet_inputs), ref) < CHANNELS_LAST_TOL


def _flags():
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


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


def _per_backend_settings():
    knobs = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.mkldnn.matmul)
    return [getattr(knob, "fp32_precision", None) for knob in knobs]


def test_tf32_scope_restores_per_backend_settings():
    if not hasattr(torch.backends.mkldnn.matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend fp32_precision settings")
    saved = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        before = _per_backend_settings()
        with tf32_scope():
            assert _per_backend_settings()[:2] == ["tf32", "tf32"]
        assert _per_backend_settings() == before
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = saved


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


def test_applying_twice_is_refused(plain):
    apply_precision_(plain, PrecisionConfig(weight_dtype="fp8_e4m3fn"))
    with pytest.raises(UserError, match=r"^module: it already has parametrized weights"):
        apply_precision_(plain, PrecisionConfig(weight_dtype="fp16"))


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
