"""The doctor's kernel trials: every attention backend against sdpa, an inductor compile and a CUDA graph
capture against eager, each passing where it runs and short of ok with its fix where it does not (faked).
The inductor compile, which costs seconds here, is faked; tests/gpu runs the CUDA rows for real."""
import sys

import pytest
import torch

from sdopt.nodes.checks import OK, UNAVAILABLE, WARN, check_attention, check_cuda_graph, check_inductor
from sdopt.nodes.checks import kernels
from sdopt.optim import cuda_graph as cuda_graph_module
from sdopt.optim.attention import Backend, Limits, register_backend, sdpa_attention, unregister_backend
from sdopt.optim.compile import config as compile_config
from sdopt.optim.cuda_graph import Captured

from .support import CPU, assert_failed, assert_fix, ctx, one, raising


# --- attention ------------------------------------------------------------------------------------


@pytest.fixture
def extra_backend():
    """Registers backends for one test and removes them afterwards."""
    names = []

    def add(backend):
        register_backend(backend)
        names.append(backend.name)

    yield add
    for name in names:
        unregister_backend(name)


def test_exact_backends_match_sdpa_and_cuda_ones_say_what_they_need(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    rows = {r.check: r for r in check_attention(ctx())}
    for name in ("sdpa", "sdpa_math", "sliced", "sub_quadratic", "naive"):
        assert rows[f"attention: {name}"].status == OK, rows[f"attention: {name}"]
    assert "against naive" in rows["attention: sdpa"].result and "against sdpa" in rows["attention: sliced"].result
    assert_fix(rows["attention: sdpa_efficient"], "NVIDIA GPU", "falls back to sdpa")
    missing = rows["attention: xformers"]
    assert missing.status == UNAVAILABLE and "not installed" in missing.result
    assert_fix(missing, "pip install xformers", torch.__version__)


def test_a_backend_built_for_another_torch(tmp_path, monkeypatch, extra_backend):
    (tmp_path / "sdopt_broken_attention.py").write_text(
        'raise OSError("libc10_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    extra_backend(Backend("broken", sdpa_attention, {"*": Limits()}, module="sdopt_broken_attention", pip="sdopt-broken-attention"))
    assert_failed(one(check_attention(ctx()), "attention: broken"), "undefined symbol",
                  "pip install --force-reinstall sdopt-broken-attention", "falls back to sdpa")


def test_a_backend_that_raises_or_differs_from_sdpa(extra_backend):
    def off(q, k, v, mask=None):
        return sdpa_attention(q, k, v, mask) + 0.1

    extra_backend(Backend("raises", raising("kernel launch failed"), {"*": Limits()}))
    extra_backend(Backend("off", off, {"*": Limits()}))
    rows = {r.check: r for r in check_attention(ctx())}
    assert_failed(rows["attention: raises"], "kernel launch failed", "update torch")
    assert rows["attention: off"].status == WARN and "beyond" in rows["attention: off"].result
    assert_fix(rows["attention: off"], "auto will not pick off")


def test_a_quantizing_backend_within_bf16s_bound_is_ok_and_beyond_it_warns(extra_backend):
    """A stand-in for SageAttention: 8-bit QK errs about as bf16 does, past fp32's and fp16's bounds."""
    def near(q, k, v, mask=None):
        return sdpa_attention(q, k, v, mask) + 0.01

    def far(q, k, v, mask=None):
        return sdpa_attention(q, k, v, mask) + 0.1

    extra_backend(Backend("near", near, {"*": Limits()}, low_precision=True, pip="near-attention"))
    extra_backend(Backend("far", far, {"*": Limits()}, low_precision=True, pip="far-attention"))
    rows = {r.check: r for r in check_attention(ctx())}
    assert rows["attention: near"].status == OK, rows["attention: near"]
    assert "quantizes inside by design" in rows["attention: near"].result and "auto never picks it" in rows["attention: near"].result
    assert rows["attention: far"].status == WARN and "beyond atol 0.03 + rtol 0.03" in rows["attention: far"].result
    assert_fix(rows["attention: far"], "choose another backend", "update far-attention")
    assert "auto will not pick" not in rows["attention: far"].fix


# --- inductor and CUDA graphs ---------------------------------------------------------------------


def test_inductor_compiles_and_matches_eager(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "compile_trial", lambda device: calls.append(device) or 2e-7)
    monkeypatch.setattr(kernels, "_cpp_compiler", lambda: "/usr/bin/g++")
    row = one(check_inductor(ctx()), "inductor")
    assert calls == [CPU] and row.status == OK and "/usr/bin/g++" in row.result


def test_inductor_without_a_cpp_compiler(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: None)
    monkeypatch.setattr(kernels, "compile_trial", lambda device: pytest.fail("must not compile without a compiler"))
    row = one(check_inductor(ctx()), "inductor")
    assert row.status == UNAVAILABLE and "C++ compiler" in row.result
    assert_fix(row, "install g++ or clang++", "trace")


def test_inductor_whose_compile_fails_or_is_wrong(monkeypatch):
    monkeypatch.setattr(kernels, "compile_trial", raising("CppCompileError: C++ compile error: fatal error: Python.h: No such file or directory"))
    assert_failed(one(check_inductor(ctx()), "inductor"), "Python.h", "C++ compiler", "aot_eager")
    monkeypatch.setattr(kernels, "compile_trial", lambda device: 0.5)
    assert_fix(one(check_inductor(ctx()), "inductor"), "mode trace")


class EagerGraphs:
    """Stands in for CUDA graph capture on a CPU: replay recomputes into the captured output."""

    def __init__(self, fail_replay=False):
        self.fail_replay = fail_replay

    def capture(self, fn, static_inputs, warmup_runs):
        output = fn(*static_inputs)

        def replay():
            if self.fail_replay:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            output.copy_(fn(*static_inputs))

        return Captured(static_inputs, output, replay)


def test_cuda_graph_capture_and_replay(monkeypatch):
    monkeypatch.setattr(cuda_graph_module, "unavailable", lambda config, device: None)
    monkeypatch.setattr(kernels, "_capture_backend", EagerGraphs)
    row = one(check_cuda_graph(ctx()), "CUDA graph")
    assert row.status == OK and "replayed" in row.result


def test_cuda_graph_on_a_cpu_and_a_failing_replay(monkeypatch):
    row = one(check_cuda_graph(ctx()), "CUDA graph")
    assert row.status == UNAVAILABLE and "CUDA device" in row.result
    assert_fix(row, "NVIDIA GPU")
    monkeypatch.setattr(cuda_graph_module, "unavailable", lambda config, device: None)
    monkeypatch.setattr(kernels, "_capture_backend", lambda: EagerGraphs(fail_replay=True))
    assert_failed(one(check_cuda_graph(ctx()), "CUDA graph"), "not permitted", "driver")
