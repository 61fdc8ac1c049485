"""SDOptCompile's error where its backend cannot run here: it names the backend input and a fix that fits."""
import importlib.util
import shutil
from types import SimpleNamespace

import pytest
import torch

from sdopt.errors import UserError
from sdopt.nodes.compile import SDOptCompile

FIND_SPEC = importlib.util.find_spec
FALLBACK = r" \(or set on_unavailable to fallback to run eager\)$"


def _patch(device, backend, mode="compile"):
    return SDOptCompile().patch(SimpleNamespace(load_device=torch.device(device)), mode, backend, "default", False, False, "error")


def test_cudagraphs_on_a_cpu_names_the_backend_and_the_backends_that_run():
    with pytest.raises(UserError, match=r"^backend: the cudagraphs backend needs a CUDA device; this model runs on cpu; "
                                        r"pick backend inductor, aot_eager or eager, or mode trace" + FALLBACK):
        _patch("cpu", "cudagraphs")


def test_inductor_on_cuda_without_triton_says_install_triton(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "triton" else FIND_SPEC(name, *args))
    with pytest.raises(UserError, match=r"^backend: inductor on CUDA needs Triton \(pip install triton\); "
                                        r"install triton, or pick backend aot_eager or eager, or mode trace" + FALLBACK):
        _patch("cuda", "inductor")


def test_inductor_on_a_cpu_without_a_compiler_says_install_one(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match=r"^backend: inductor on a CPU needs a C\+\+ compiler \(g\+\+ or clang\+\+\); "
                                        r"install g\+\+ or clang\+\+, or pick backend aot_eager or eager, or mode trace" + FALLBACK):
        _patch("cpu", "inductor")
