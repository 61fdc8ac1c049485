"""The backend registry: what each backend needs (``Backend``, ``Limits``) and whether it runs on given
tensors (``Availability``, ``available``), the names a user may ask for, ``AttentionConfig`` (validated
against the registry, so it lives here), and the built-in backends' entries."""
from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from ...errors import UserError
from .config import (
    ANY_DEVICE,
    AUTO,
    DEFAULT_MEMORY_BUDGET_BYTES,
    FLOAT_DTYPES,
    HALF_DTYPES,
    LOW_MEMORY,
    ON_UNAVAILABLE,
    SDPA_FUSED,
    SELECTIONS,
    TOLERANCE_BF16,
    TOLERANCE_FP32,
    TOLERANCES,
    AttentionFn,
    Tolerance,
    dtype_name,
)
from .kernels import (
    flash_attn_attention,
    forced_sdpa,
    naive_attention,
    sage_attention,
    sdpa_attention,
    sdpa_fused_attention,
    sliced_attention,
    sub_quadratic_attention,
    xformers_attention,
)


@dataclass(frozen=True)
class AttentionConfig:
    """What to run: a backend name or ``"auto"``, and the knobs of the chunked backends.

    ``slice_size``: query tokens per slice for ``sliced``; 0 derives it from the memory budget.
    ``head_slice_size``: heads per slice for ``sliced``; 0 takes all heads at once.
    ``memory_budget_bytes``: the score temporaries of one ``sliced`` slice (when ``slice_size``
    is 0) or one ``sub_quadratic`` chunk stay within this.
    """

    backend: str = "sdpa"
    on_unavailable: str = "fallback"
    slice_size: int = 0
    head_slice_size: int = 0
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES

    def __post_init__(self):
        if self.backend not in SELECTIONS:
            get_backend(self.backend)
        if self.on_unavailable not in ON_UNAVAILABLE:
            raise UserError(f"on_unavailable: must be one of {', '.join(ON_UNAVAILABLE)}, not {self.on_unavailable!r}")
        for name in ("slice_size", "head_slice_size"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}: {getattr(self, name)} must be >= 0 (0 = automatic)")
        if self.memory_budget_bytes <= 0:
            raise UserError(f"memory_budget_bytes: {self.memory_budget_bytes} must be > 0")


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Limits:
    """What a backend accepts on one device type."""

    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    max_head_dim: int | None = None
    mask: bool = True


@dataclass(frozen=True)
class Backend:
    """One registry entry. ``limits`` maps a device type (or ``ANY_DEVICE``) to what runs there;
    ``module``/``pip`` name an optional package; ``options`` name the ``AttentionConfig`` fields
    that are passed to ``fn`` as keyword arguments; ``low_precision``: it quantizes inside, so a
    caller that asks for attention at its inputs' precision must not get it; ``linear_memory``: it
    never holds a query-by-key score matrix (fused kernels, slices and chunks within a budget), None
    where that depends on the kernel PyTorch picks."""

    name: str
    fn: AttentionFn
    limits: Mapping[str, Limits]
    description: str = ""
    module: str | None = None
    pip: str | None = None
    options: tuple[str, ...] = ()
    low_precision: bool = False
    linear_memory: bool | None = True

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """How close to exact attention this backend's output at ``dtype`` must come. A backend that
        quantizes inside is held to bf16's bound where the dtype's is tighter: its 8-bit products
        err about as much as bf16 attention does (SageAttention at fp16: 1.1e-02 from sdpa on an
        H200, against fp16's 5e-03), and that is by design, not a fault."""
        own = TOLERANCES.get(dtype, TOLERANCE_FP32)
        if self.low_precision and own.atol < TOLERANCE_BF16.atol:
            return TOLERANCE_BF16
        return own

    def check(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        has_mask: bool = False,
    ) -> Availability:
        """Whether this backend can run; facts given as None are not checked."""
        if self.module is not None:
            problem = _import_problem(self.module, self.pip)
            if problem:
                return Availability(False, problem)
        if device is None:
            return Availability(True)
        device_type = torch.device(device).type
        limits = self.limits.get(device_type, self.limits.get(ANY_DEVICE))
        if limits is None:
            runs_on = sorted(self.limits)
            if runs_on == ["cuda"]:
                return Availability(False, f"{self.name} needs CUDA")
            return Availability(False, f"{self.name} does not run on {device_type} (runs on: {', '.join(runs_on)})")
        if dtype is not None and dtype not in limits.dtypes:
            allowed = ", ".join(dtype_name(d) for d in limits.dtypes)
            return Availability(False, f"{self.name} on {device_type} supports {allowed} (got {dtype_name(dtype)})")
        if head_dim is not None and limits.max_head_dim is not None and head_dim > limits.max_head_dim:
            return Availability(False, f"{self.name} supports head dim <= {limits.max_head_dim} (got {head_dim})")
        if has_mask and not limits.mask:
            return Availability(False, f"{self.name} on {device_type} does not support attention masks")
        return Availability(True)


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    if backend.name in SELECTIONS:
        raise ValueError(f"{backend.name!r} is reserved for a selection among backends")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def attention_choices() -> tuple[str, ...]:
    """Every name a user may ask for: ``"auto"``, ``"low_memory"`` and the registered backends."""
    return (*SELECTIONS, *_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"backend: unknown attention backend {name!r}; choose from {', '.join(attention_choices())}") from None


def runs_low_precision(selection: str) -> bool:
    """Whether ``selection`` names a backend that quantizes inside (``auto`` never picks one)."""
    return selection in _REGISTRY and _REGISTRY[selection].low_precision


def attention_memory_is_linear(selection: str) -> bool | None:
    """Whether attention chosen as ``selection`` (``auto``, ``low_memory`` or the backend that runs)
    keeps its memory linear in the tokens; None where it depends on the call: ``auto``'s per-shape
    pick, plain sdpa's kernel."""
    if selection == AUTO:
        return None
    return True if selection == LOW_MEMORY else get_backend(selection).linear_memory


def backend_function(name: str, config: AttentionConfig | None = None) -> AttentionFn:
    """The backend's ``fn(q, k, v, mask=None)`` with its options taken from ``config``."""
    backend = get_backend(name)
    config = config or AttentionConfig()
    if not backend.options:
        return backend.fn
    return functools.partial(backend.fn, **{option: getattr(config, option) for option in backend.options})


def available(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Availability:
    """Whether backend ``name`` can run on these tensors, and if not, why."""
    if name not in _REGISTRY:
        return Availability(False, f"unknown attention backend {name!r}")
    problem = _shape_problem(q, k, v, mask)
    if problem:
        return Availability(False, problem)
    return _REGISTRY[name].check(q.device, q.dtype, q.shape[-1], mask is not None)


def _import_problem(module: str, pip: str | None) -> str:
    """'' when ``module`` imports; otherwise why not, naming the pip package."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] == top:
            return f"{pip or top} is not installed: pip install {pip or top}"
        return f"{module} failed to import: {error}"
    except Exception as error:  # broken binary installs raise OSError, RuntimeError, ...
        return f"{module} failed to import: {type(error).__name__}: {error}"
    return ""


def _shape_problem(q, k, v, mask) -> str:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q, k and v must be 4-D [B, H, N, D]"
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return f"q{list(q.shape)}, k{list(k.shape)} and v{list(v.shape)} do not fit [B, H, Nq, D], [B, H, Nk, D]"
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        return "q, k and v must share dtype and device"
    if mask is not None:
        full = (*q.shape[:3], k.shape[2])
        if mask.ndim > 4 or any(m not in (1, f) for m, f in zip(mask.shape[::-1], full[::-1])):
            return f"mask{list(mask.shape)} does not broadcast to {list(full)}"
    return ""


# --- the built-in backends ---------------------------------------------------------------------

_ALL_FLOAT = {ANY_DEVICE: Limits()}
# FlashAttention's kernels on CUDA, PyTorch's (sdpa_flash) and the flash-attn package's alike
_FLASH_ON_CUDA = Limits(dtypes=HALF_DTYPES, max_head_dim=256, mask=False)

for _backend in (
    Backend("sdpa", sdpa_attention, _ALL_FLOAT, "PyTorch scaled_dot_product_attention, kernel picked by PyTorch", linear_memory=None),
    Backend(
        "sdpa_flash",
        forced_sdpa(SDPBackend.FLASH_ATTENTION),
        {"cpu": Limits(), "cuda": _FLASH_ON_CUDA},
        "SDPA forced to its FlashAttention kernel",
    ),
    Backend(
        "sdpa_efficient",
        forced_sdpa(SDPBackend.EFFICIENT_ATTENTION),
        {"cuda": Limits()},
        "SDPA forced to its memory-efficient kernel",
    ),
    Backend("sdpa_math", forced_sdpa(SDPBackend.MATH), _ALL_FLOAT, "SDPA forced to its math kernel", linear_memory=False),
    Backend(
        SDPA_FUSED,
        sdpa_fused_attention,
        {"cpu": Limits(), "cuda": Limits()},
        "SDPA limited to its fused kernels (flash, memory-efficient): memory linear in the tokens",
    ),
    Backend(
        "xformers",
        xformers_attention,
        {"cuda": Limits()},
        "xFormers memory_efficient_attention",
        module="xformers.ops",
        pip="xformers",
    ),
    Backend(
        "sage",
        sage_attention,
        {"cuda": Limits(dtypes=HALF_DTYPES, max_head_dim=128, mask=False)},
        "SageAttention (8-bit QK)",
        module="sageattention",
        pip="sageattention",
        low_precision=True,
    ),
    Backend(
        "flash_attn",
        flash_attn_attention,
        {"cuda": _FLASH_ON_CUDA},
        "FlashAttention 2 (flash-attn package)",
        module="flash_attn",
        pip="flash-attn",
    ),
    Backend(
        "sliced",
        sliced_attention,
        _ALL_FLOAT,
        "exact attention per query slice (and head slice)",
        options=("slice_size", "head_slice_size", "memory_budget_bytes"),
    ),
    Backend(
        "sub_quadratic",
        sub_quadratic_attention,
        _ALL_FLOAT,
        "query and key chunks with an online softmax",
        options=("memory_budget_bytes",),
    ),
    Backend("naive", naive_attention, _ALL_FLOAT, "softmax(QK^T * scale) V, the reference", linear_memory=False),
):
    register_backend(_backend)
del _backend
