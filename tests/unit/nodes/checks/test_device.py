"""The doctor's device, torch and dtype checks pass on the CPU, and where their thing does not run (faked)
give a status short of ok with the fix."""
import pytest
import torch

from sdopt.nodes.checks import FAILED, OK, UNAVAILABLE, check_device, check_dtypes, check_torch
from sdopt.nodes.checks import device as device_checks
from sdopt.optim import precision as precision_module

from .support import assert_failed, assert_fix, ctx, one, raising


# --- device and torch -----------------------------------------------------------------------------


def test_device_runs_a_kernel_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    row = one(check_device(ctx()), "device")
    assert row.status == OK and row.result.startswith("CPU ") and "cores" in row.result


def test_device_warns_when_a_cuda_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_fix(one(check_device(ctx()), "device"), "nvidia-smi")


def test_device_without_kernels_for_its_architecture(monkeypatch):
    monkeypatch.setattr(device_checks, "_run_on_device", raising("CUDA error: no kernel image is available for execution on the device"))
    assert_failed(one(check_device(ctx()), "device"), "no kernel image", "architecture", "pytorch.org")


def test_torch_runs_conv_and_matmul():
    row = one(check_torch(ctx()), "torch")
    assert row.status == OK and torch.__version__ in row.result


def test_torch_below_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    assert_fix(one(check_torch(ctx()), "torch"), "torch>=2.7")


def test_torch_whose_kernels_fail(monkeypatch):
    monkeypatch.setattr(device_checks, "_matmul_and_conv", raising("cuBLAS error"))
    assert_failed(one(check_torch(ctx()), "torch"), "cuBLAS", "pytorch.org")


# --- dtypes ---------------------------------------------------------------------------------------


def test_every_dtype_is_stored_and_computed_on_the_cpu():
    rows = check_dtypes(ctx())
    names = [r.check for r in rows]
    assert names == ["bf16 storage", "fp16 storage", "fp8_e4m3fn storage", "fp8_e5m2 storage", "bf16 compute", "fp16 compute", "fp8 compute"]
    assert all(r.status == OK for r in rows), [r for r in rows if r.status != OK]
    fp8 = one(rows, "fp8 compute")
    assert "fp32 emulation" in fp8.tried and "on a CPU it checks numbers, it saves no time" in fp8.result


def test_storage_that_cannot_be_made_or_comes_back_wrong(monkeypatch):
    def round_trip(device, dtype):
        if dtype == torch.float8_e5m2:
            raise TypeError("float8_e5m2 is not supported")
        return 1.0 if dtype == torch.float16 else 0.0

    monkeypatch.setattr(device_checks, "_round_trip", round_trip)
    rows = check_dtypes(ctx())
    assert one(rows, "bf16 storage").status == OK
    assert_fix(one(rows, "fp8_e5m2 storage"), "pip install -U torch")
    assert_failed(one(rows, "fp16 storage"), "round-trip error 1.0e+00 (expected at most", "update torch")


def test_compute_that_fails_or_is_wrong(monkeypatch):
    def matmul_and_conv(device, dtype):
        if dtype == torch.bfloat16:
            raise RuntimeError('"slow_conv2d_cpu" not implemented for BFloat16')
        return 0.5

    monkeypatch.setattr(device_checks, "_matmul_and_conv", matmul_and_conv)
    rows = check_dtypes(ctx())
    assert one(rows, "bf16 compute").status == UNAVAILABLE
    assert_fix(one(rows, "bf16 compute"), "auto picks what runs here")
    assert one(rows, "fp16 compute").status == FAILED
    assert_fix(one(rows, "fp16 compute"), "compute_dtype at fp32")


@pytest.mark.parametrize("error", [float("nan"), 0.5])
def test_compute_whose_error_is_not_a_number_or_too_large_fails(monkeypatch, error):
    monkeypatch.setattr(device_checks, "_matmul_and_conv", lambda device, dtype: error)
    assert_failed(one(check_dtypes(ctx()), "fp16 compute"), f"relative error {error:.1e}, above 1e-02", "compute_dtype at fp32")


def test_fp8_compute_where_scaled_matmuls_do_not_run(monkeypatch):
    monkeypatch.setattr(precision_module, "_fp8_product",
                        raising("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9"))
    row = one(check_dtypes(ctx()), "fp8 compute")
    assert row.status == UNAVAILABLE and "compute capability" in row.result
    assert_fix(row, "8.9", "fp8 weight_dtype still halves")
