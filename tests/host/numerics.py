"""Numeric helpers that host tests share: how far a patched output is from its reference, and the dtypes
a module stores. Test modules import them relatively (``from ..numerics import rel_err``): they cannot
import conftest under ``--import-mode=importlib``."""


def rel_err(out, ref) -> float:
    """Relative L2 error of ``out`` against ``ref``, both taken as float32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def stored_dtypes(module) -> set:
    """The dtypes of ``module``'s parameters."""
    return {p.dtype for p in module.parameters()}
