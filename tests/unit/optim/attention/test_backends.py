"""The registry: the backends a CPU has, what each needs (package, device, dtype, head dim, mask) and
the reason when it cannot run, the config's validation, reserved names, and the tolerances."""
import pytest
import torch

from sdopt.errors import UserError
from sdopt.optim.attention.backends import (
    AttentionConfig,
    Backend,
    Limits,
    available,
    backend_names,
    get_backend,
    register_backend,
    runs_low_precision,
)
from sdopt.optim.attention.config import (
    ANY_DEVICE,
    AUTO,
    SELECTIONS,
    TOLERANCE_BF16,
    TOLERANCE_FP16,
    TOLERANCE_FP32,
)
from sdopt.optim.attention.kernels import naive_attention

from .support import CPU_BACKENDS, qkv


OPTIONAL = {"xformers": "xformers", "sage": "sageattention", "flash_attn": "flash-attn"}


def test_cpu_has_the_portable_backends():
    assert {"sdpa", "sdpa_math", "sliced", "sub_quadratic", "naive"} <= set(CPU_BACKENDS)


def test_only_quantizing_backends_run_low_precision():
    assert runs_low_precision("sage")
    assert not any(runs_low_precision(name) for name in (*backend_names(), AUTO, "low_memory") if name != "sage")


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_missing_optional_packages_are_named_with_pip(name):
    package = OPTIONAL[name]
    q, k, v = qkv(1, 2, 8, 8, 64, torch.float16)
    verdict = available(name, q, k, v)
    if verdict.ok or "not installed" not in verdict.reason:
        pytest.skip(f"{package} is installed here")
    assert not verdict.ok
    assert verdict.reason == f"{package} is not installed: pip install {package}"


def test_device_dtype_head_dim_and_mask_reasons():
    q, k, v = qkv(1, 2, 8, 8, 64)
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
    q, k, v = qkv(1, 2, 8, 9, 16)
    assert not available("sdpa", q, k[:, :1], v).ok
    assert not available("sdpa", q, k, v, torch.zeros(8, 5)).ok
    assert available("sdpa", q, k, v, torch.zeros(8, 9)).ok
    assert "unknown" in available("nope", q, k, v).reason


def test_config_is_validated():
    with pytest.raises(UserError, match="on_unavailable"):
        AttentionConfig(on_unavailable="ignore")
    with pytest.raises(UserError, match="choose from auto, low_memory, sdpa"):
        AttentionConfig(backend="sdap")
    with pytest.raises(UserError):
        AttentionConfig(memory_budget_bytes=0)
    assert AttentionConfig(backend=AUTO).backend == AUTO


def test_selections_are_reserved_names():
    for name in SELECTIONS:
        with pytest.raises(ValueError, match="reserved"):
            register_backend(Backend(name, naive_attention, {ANY_DEVICE: Limits()}))


def test_a_quantizing_backend_is_held_to_bf16s_bound_where_its_dtype_is_tighter():
    quantized = Backend("quantized", naive_attention, {ANY_DEVICE: Limits()}, low_precision=True)
    exact = get_backend("sdpa")
    assert quantized.tolerance(torch.float16) == TOLERANCE_BF16 and exact.tolerance(torch.float16) == TOLERANCE_FP16
    assert quantized.tolerance(torch.bfloat16) == exact.tolerance(torch.bfloat16) == TOLERANCE_BF16
    assert quantized.tolerance(torch.float32) == TOLERANCE_BF16 and exact.tolerance(torch.float32) == TOLERANCE_FP32
