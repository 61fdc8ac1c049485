"""sdopt doctor: every check passes where its thing runs, and where it does not (faked) gives a status
short of ok with its fix. The trials that cost seconds here (the inductor compile, the CPU's bf16 timing
probe) are faked; tests/host runs the whole doctor for real, and tests/gpu its CUDA rows."""
import json
import sys
import types

import pytest
import torch

from sdopt.optim.compile import cache as compile_cache, config as compile_config
from sdopt.optim import cuda_graph as cuda_graph_module
from sdopt.optim import precision as precision_module
from sdopt.optim.attention import Backend, Limits, register_backend, sdpa_attention, unregister_backend
from sdopt.optim.cuda_graph import Captured
from sdopt.optim.precision import AutoPick
from sdopt.tools import doctor
from sdopt.tools.cli import main
from sdopt.tools.doctor import FAILED, OK, STATUSES, UNAVAILABLE, WARN, CheckRow, ComfyInfo, Context

CPU = torch.device("cpu")


def ctx(comfyui=None) -> Context:
    return Context(CPU, comfyui)


def one(rows, check):
    (row,) = [r for r in rows if r.check == check]
    return row


def assert_fix(row, *words):
    assert row.status != OK and row.fix, row
    for word in words:
        assert word in row.fix, (word, row.fix)


@pytest.fixture(autouse=True)
def fast_precision_pick(monkeypatch):
    """pick_dtype times bf16 against fp32 on a CPU (seconds); its answer is not what these tests check."""
    monkeypatch.setattr(precision_module, "pick_dtype", lambda device: AutoPick(torch.float32, "faked pick"))


def test_a_row_short_of_ok_must_carry_its_fix():
    with pytest.raises(ValueError, match="needs a fix"):
        CheckRow("x", "tried", WARN, "result")
    with pytest.raises(ValueError, match="status"):
        CheckRow("x", "tried", "fine", "result")
    assert CheckRow("x", "tried", OK, "result").fix == ""


# --- device and torch ----------------------------------------------------------------------------------


def test_device_runs_a_kernel_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    row = one(doctor.check_device(ctx()), "device")
    assert row.status == OK and row.result.startswith("CPU ") and "cores" in row.result


def test_device_warns_when_a_cuda_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_fix(one(doctor.check_device(ctx()), "device"), "nvidia-smi")


def test_device_without_kernels_for_its_architecture(monkeypatch):
    def no_kernel(device):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(doctor, "_run_on_device", no_kernel)
    row = one(doctor.check_device(ctx()), "device")
    assert row.status == FAILED and "no kernel image" in row.result
    assert_fix(row, "architecture", "pytorch.org")


def test_torch_runs_conv_and_matmul():
    row = one(doctor.check_torch(ctx()), "torch")
    assert row.status == OK and torch.__version__ in row.result


def test_torch_below_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    assert_fix(one(doctor.check_torch(ctx()), "torch"), "torch>=2.7")


def test_torch_whose_kernels_fail(monkeypatch):
    def broken(device, dtype):
        raise RuntimeError("cuBLAS error")

    monkeypatch.setattr(doctor, "_matmul_and_conv", broken)
    row = one(doctor.check_torch(ctx()), "torch")
    assert row.status == FAILED and "cuBLAS" in row.result
    assert_fix(row, "pytorch.org")


# --- dtypes ----------------------------------------------------------------------------------------------


def test_every_dtype_is_stored_and_computed_on_the_cpu():
    rows = doctor.check_dtypes(ctx())
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

    monkeypatch.setattr(doctor, "_round_trip", round_trip)
    rows = doctor.check_dtypes(ctx())
    assert one(rows, "bf16 storage").status == OK
    assert_fix(one(rows, "fp8_e5m2 storage"), "pip install -U torch")
    wrong = one(rows, "fp16 storage")
    assert wrong.status == FAILED and "round-trip error 1.0e+00" in wrong.result
    assert_fix(wrong, "update torch")


def test_compute_that_fails_or_is_wrong(monkeypatch):
    def matmul_and_conv(device, dtype):
        if dtype == torch.bfloat16:
            raise RuntimeError('"slow_conv2d_cpu" not implemented for BFloat16')
        return 0.5

    monkeypatch.setattr(doctor, "_matmul_and_conv", matmul_and_conv)
    rows = doctor.check_dtypes(ctx())
    assert one(rows, "bf16 compute").status == UNAVAILABLE
    assert_fix(one(rows, "bf16 compute"), "auto picks what runs here")
    assert one(rows, "fp16 compute").status == FAILED
    assert_fix(one(rows, "fp16 compute"), "compute_dtype at fp32")


def test_fp8_compute_where_scaled_matmuls_do_not_run(monkeypatch):
    def scaled_mm(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9")

    monkeypatch.setattr(precision_module, "_fp8_product", scaled_mm)
    row = one(doctor.check_dtypes(ctx()), "fp8 compute")
    assert row.status == UNAVAILABLE and "compute capability" in row.result
    assert_fix(row, "8.9", "fp8 weight_dtype still halves")


# --- attention -------------------------------------------------------------------------------------------


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
    rows = {r.check: r for r in doctor.check_attention(ctx())}
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
    row = one(doctor.check_attention(ctx()), "attention: broken")
    assert row.status == FAILED and "undefined symbol" in row.result
    assert_fix(row, "pip install --force-reinstall sdopt-broken-attention", "falls back to sdpa")


def test_a_backend_that_raises_or_differs_from_sdpa(extra_backend):
    def raises(q, k, v, mask=None):
        raise RuntimeError("kernel launch failed")

    def off(q, k, v, mask=None):
        return sdpa_attention(q, k, v, mask) + 0.1

    extra_backend(Backend("raises", raises, {"*": Limits()}))
    extra_backend(Backend("off", off, {"*": Limits()}))
    rows = {r.check: r for r in doctor.check_attention(ctx())}
    assert rows["attention: raises"].status == FAILED and "kernel launch failed" in rows["attention: raises"].result
    assert_fix(rows["attention: raises"], "update torch")
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
    rows = {r.check: r for r in doctor.check_attention(ctx())}
    assert rows["attention: near"].status == OK, rows["attention: near"]
    assert "quantizes inside by design" in rows["attention: near"].result and "auto never picks it" in rows["attention: near"].result
    assert rows["attention: far"].status == WARN and "beyond atol 0.03 + rtol 0.03" in rows["attention: far"].result
    assert_fix(rows["attention: far"], "choose another backend", "update far-attention")
    assert "auto will not pick" not in rows["attention: far"].fix


# --- inductor and CUDA graphs ------------------------------------------------------------------------------


def test_inductor_compiles_and_matches_eager(monkeypatch):
    calls = []
    monkeypatch.setattr(doctor, "compile_trial", lambda device: calls.append(device) or 2e-7)
    monkeypatch.setattr(doctor, "_cpp_compiler", lambda: "/usr/bin/g++")
    row = one(doctor.check_inductor(ctx()), "inductor")
    assert calls == [CPU] and row.status == OK and "/usr/bin/g++" in row.result


def test_inductor_without_a_cpp_compiler(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: None)
    monkeypatch.setattr(doctor, "compile_trial", lambda device: pytest.fail("must not compile without a compiler"))
    row = one(doctor.check_inductor(ctx()), "inductor")
    assert row.status == UNAVAILABLE and "C++ compiler" in row.result
    assert_fix(row, "install g++ or clang++", "trace")


def test_inductor_whose_compile_fails_or_is_wrong(monkeypatch):
    def fails(device):
        raise RuntimeError("CppCompileError: C++ compile error: fatal error: Python.h: No such file or directory")

    monkeypatch.setattr(doctor, "compile_trial", fails)
    row = one(doctor.check_inductor(ctx()), "inductor")
    assert row.status == FAILED and "Python.h" in row.result
    assert_fix(row, "C++ compiler", "aot_eager")
    monkeypatch.setattr(doctor, "compile_trial", lambda device: 0.5)
    assert_fix(one(doctor.check_inductor(ctx()), "inductor"), "mode trace")


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
    monkeypatch.setattr(doctor, "_capture_backend", EagerGraphs)
    row = one(doctor.check_cuda_graph(ctx()), "CUDA graph")
    assert row.status == OK and "replayed" in row.result


def test_cuda_graph_on_a_cpu_and_a_failing_replay(monkeypatch):
    row = one(doctor.check_cuda_graph(ctx()), "CUDA graph")
    assert row.status == UNAVAILABLE and "CUDA device" in row.result
    assert_fix(row, "NVIDIA GPU")
    monkeypatch.setattr(cuda_graph_module, "unavailable", lambda config, device: None)
    monkeypatch.setattr(doctor, "_capture_backend", lambda: EagerGraphs(fail_replay=True))
    row = one(doctor.check_cuda_graph(ctx()), "CUDA graph")
    assert row.status == FAILED and "not permitted" in row.result
    assert_fix(row, "driver")


# --- ComfyUI ---------------------------------------------------------------------------------------------


def test_comfyui_found_with_every_api_and_classic_memory():
    rows = doctor.check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.3.75")))
    assert [r.status for r in rows] == [OK, OK]
    assert "0.3.75 at /opt/ComfyUI" in rows[0].result and "no dynamic VRAM" in rows[1].result


def test_comfyui_missing_broken_or_too_old():
    assert_fix(one(doctor.check_comfyui(ctx()), "ComfyUI"), "--comfyui", "COMFYUI_PATH")
    broken = one(doctor.check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.38.1", error="ModuleNotFoundError: No module named 'comfy_aimdo'"))), "ComfyUI")
    assert broken.status == FAILED and "comfy_aimdo" in broken.result
    assert_fix(broken, "requirements.txt")
    old = one(doctor.check_comfyui(ctx(ComfyInfo("/opt/ComfyUI", "0.3.40", ("per-model attention override (0.3.60+)",)))), "ComfyUI")
    assert old.status == FAILED and "attention override" in old.result
    assert_fix(old, "0.3.64")


def _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled: bool):
    """The modules a ComfyUI 0.38 server has imported, with what sdopt looks for, and its version file."""
    wrappers = types.SimpleNamespace(**{name: name.lower() for name in ("DIFFUSION_MODEL", "OUTER_SAMPLE", "SAMPLER_SAMPLE", "APPLY_MODEL", "PREPARE_SAMPLING")})
    patcher = type("ModelPatcher", (), {name: None for name in ("add_wrapper_with_key", "partially_unload", "partially_load")})
    modules = {
        "comfy.ldm.modules.attention": types.SimpleNamespace(wrap_attn=lambda f: f),
        "comfy.model_patcher": types.SimpleNamespace(ModelPatcher=patcher),
        "comfy.patcher_extension": types.SimpleNamespace(WrappersMP=wrappers),
        "comfy.memory_management": types.SimpleNamespace(aimdo_enabled=aimdo_enabled),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "comfyui_version.py").write_text('# generated\n__version__ = "0.38.1"\n')


def test_comfyui_038_with_dynamic_vram_on_warns_with_the_flag_that_turns_it_off(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=True)
    info = doctor.comfyui_info(tmp_path, in_server=True)
    assert info.version == "0.38.1" and info.missing_apis == () and info.dynamic_vram is True
    api, mode = doctor.check_comfyui(ctx(info))
    assert api.status == OK
    assert mode.status == WARN and "dynamic VRAM (comfy-aimdo) is on" in mode.result
    assert_fix(mode, "--disable-dynamic-vram", "non-dynamic delegate")


def test_comfyui_038_with_dynamic_vram_off(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    mode = one(doctor.check_comfyui(ctx(doctor.comfyui_info(tmp_path, in_server=True))), "ComfyUI memory mode")
    assert mode.status == OK and "offers dynamic VRAM, and it is off" in mode.result


@pytest.mark.parametrize(("nvidia", "status", "says"), [
    (True, WARN, "a server (main.py) on this GPU turns it on by default"),
    (False, OK, "stays off here (this GPU is not one that ComfyUI manages with dynamic VRAM)"),
])
def test_comfyui_038_from_the_cli_says_what_a_server_would_do_on_this_gpu(monkeypatch, tmp_path, nvidia, status, says):
    """The CLI imports ComfyUI without starting it: the row gives the start-up decision of ``sdopt run``."""
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", types.SimpleNamespace(enables_dynamic_vram=lambda: True))
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.SimpleNamespace(is_nvidia=lambda: nvidia, torch_version_numeric=(2, 11)))
    monkeypatch.setitem(sys.modules, "comfy_aimdo", types.ModuleType("comfy_aimdo"))
    cuda = Context(torch.device("cuda", 0), doctor.comfyui_info(tmp_path, in_server=False))
    mode = one(doctor.check_comfyui(cuda), "ComfyUI memory mode")
    assert mode.status == status and says in mode.result
    on_cpu = one(doctor.check_comfyui(ctx(doctor.comfyui_info(tmp_path, in_server=False))), "ComfyUI memory mode")
    assert on_cpu.status == OK and "stays off here (no CUDA device" in on_cpu.result


def test_comfyui_apis_missing_from_the_imported_modules(monkeypatch, tmp_path):
    _fake_comfyui_038(monkeypatch, tmp_path, aimdo_enabled=False)
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", types.SimpleNamespace())
    info = doctor.comfyui_info(tmp_path, in_server=True)
    assert info.missing_apis == ("per-model attention override (0.3.60+)",)
    node = one(doctor.check_nodes(ctx(info)), "node: sdopt Attention")
    assert node.status == UNAVAILABLE
    assert_fix(node, "0.3.60")


def test_load_comfyui_reports_a_folder_that_is_no_comfyui(tmp_path):
    info = doctor.load_comfyui(tmp_path)
    assert info.error and "ComfyUI not found" in info.error
    assert doctor.load_comfyui(None) is None
    assert "comfy" not in sys.modules


# --- compile cache -------------------------------------------------------------------------------------------


def test_compile_cache_lists_sdopts_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path))
    entry = tmp_path / "abc-torch-compile"
    entry.mkdir()
    (entry / "meta.json").write_text(json.dumps({"written_by": compile_cache.WRITTEN_BY, "key": entry.name}))
    (entry / "graph.bin").write_bytes(b"x" * 2**20)
    (tmp_path / "someone-elses").mkdir()
    row = one(doctor.check_compile_cache(ctx()), "compile cache")
    assert row.status == OK and f"{tmp_path}: 1 entry, 1.0 MiB" in row.result and "1 other item" in row.result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc-torch-compile", "someone-elses"], "the probe file is gone"


def test_compile_cache_that_cannot_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path / "cache"))

    def read_only(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(doctor, "_write_probe", read_only)
    row = one(doctor.check_compile_cache(ctx()), "compile cache")
    assert row.status == FAILED and "Permission denied" in row.result
    assert_fix(row, "SDOPT_CACHE_DIR")


# --- per node --------------------------------------------------------------------------------------------------


NODES = ["sdopt Precision", "sdopt VAE Precision", "sdopt Attention", "sdopt VAE Attention", "sdopt Compile", "sdopt CUDA Graph",
         "sdopt Offload", "sdopt Tiled VAE", "sdopt Low Memory", "sdopt Step Cache", "sdopt Profiler", "sdopt Profile Report"]


def test_nodes_on_a_cpu_say_which_modes_run_and_why_the_others_do_not(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: "/usr/bin/g++")
    rows = {r.check.removeprefix("node: "): r for r in doctor.check_nodes(ctx())}
    assert list(rows) == NODES
    for name in ("sdopt VAE Precision", "sdopt Tiled VAE", "sdopt Low Memory", "sdopt Step Cache", "sdopt Profiler"):
        assert rows[name].status == OK, rows[name]
    assert "auto → float32 (faked pick)" in rows["sdopt Precision"].result
    assert rows["sdopt Precision"].status == WARN and "tf32" in rows["sdopt Precision"].result
    assert "compile and compile_regional with inductor, aot_eager, eager" in rows["sdopt Compile"].result
    assert_fix(rows["sdopt Compile"], "pick backend inductor")
    assert_fix(rows["sdopt CUDA Graph"], "NVIDIA GPU")
    assert rows["sdopt CUDA Graph"].status == UNAVAILABLE
    assert rows["sdopt Offload"].status == UNAVAILABLE
    assert_fix(rows["sdopt Offload"], "already in RAM")


def test_compile_node_without_a_compiler_or_after_a_failed_inductor_trial(monkeypatch):
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: None)
    row = one(doctor.check_nodes(ctx()), "node: sdopt Compile")
    assert "backend inductor (inductor on a CPU needs a C++ compiler" in row.result and "trace" in row.result
    assert_fix(row, "install g++ or clang++")
    monkeypatch.setattr(compile_config.shutil, "which", lambda name: "/usr/bin/g++")
    context = ctx()
    context.rows["inductor"] = CheckRow("inductor", "tried", FAILED, "the compile failed: CppCompileError", "fix")
    row = one(doctor.check_nodes(context), "node: sdopt Compile")
    assert "backend inductor (the inductor trial: the compile failed" in row.result
    assert_fix(row, "inductor row")


def test_report_node_without_matplotlib(monkeypatch):
    real = doctor.importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    row = one(doctor.check_nodes(ctx()), "node: sdopt Profile Report")
    assert row.status == WARN
    assert_fix(row, "pip install matplotlib")


def test_attention_node_leaves_out_a_backend_whose_trial_failed():
    context = ctx()
    context.rows["attention: sliced"] = CheckRow("attention: sliced", "tried", FAILED, "raised RuntimeError: boom", "fix")
    row = one(doctor.check_nodes(context), "node: sdopt Attention")
    assert "sliced (raised RuntimeError: boom)" in row.result and ", sliced," not in row.result


# --- running them all ----------------------------------------------------------------------------------------------


def test_a_check_that_raises_is_one_failed_row_and_the_others_still_run(monkeypatch):
    def explodes(ctx):
        raise KeyError("surprise")

    monkeypatch.setattr(doctor, "CHECKS", (("device", doctor.check_device), ("boom", explodes), ("CUDA graph", doctor.check_cuda_graph)))
    rows = doctor.run_checks("cpu")
    assert [r.check for r in rows] == ["device", "boom", "CUDA graph"]
    assert rows[1].status == FAILED and "KeyError" in rows[1].result and "in explodes" in rows[1].result
    assert_fix(rows[1], "issues")
    assert all(r.seconds >= 0 for r in rows)


def test_cli_prints_the_table_and_writes_one_json_object_per_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(doctor, "CHECKS", (("device", doctor.check_device), ("CUDA graph", doctor.check_cuda_graph)))
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--no-comfyui", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| check | status | result | fix | tried |" in printed and "| CUDA graph | unavailable |" in printed
    rows = json.loads(out.read_text())
    assert [r["check"] for r in rows] == ["device", "CUDA graph"]
    assert all(r["status"] in STATUSES and set(r) >= {"check", "tried", "status", "result", "fix", "seconds"} for r in rows)
    assert rows[1]["fix"]


def test_cli_exits_1_when_a_check_failed(monkeypatch, tmp_path, capsys):
    def no_kernel(device):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(doctor, "_run_on_device", no_kernel)
    monkeypatch.setattr(doctor, "CHECKS", (("device", doctor.check_device),))
    assert main(["doctor", "--no-comfyui", "--device", "cpu"]) == 1
    assert "| device | failed |" in capsys.readouterr().out


@pytest.fixture
def checks_run(monkeypatch):
    """The devices the (one, recording) check ran on."""
    devices = []

    def record(ctx):
        devices.append(ctx.device)
        return [CheckRow("device", "recorded the device", OK, str(ctx.device))]

    monkeypatch.setattr(doctor, "CHECKS", (("device", record),))
    return devices


def _cli_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("sdopt: error: "), err
    return err[-1].removeprefix("sdopt: error: ")


def test_cli_refuses_a_device_torch_cannot_parse(checks_run, capsys):
    error = _cli_error(["doctor", "--no-comfyui", "--device", "foo"], capsys)
    assert error.startswith("--device 'foo' is not a device torch knows (") and error.endswith("give e.g. cpu, cuda or cuda:1")
    assert checks_run == []


@pytest.mark.parametrize("cuda, hip, build", [("13.0", None, "built for CUDA 13.0 but finds no GPU"),
                                              (None, "6.4", "built for ROCm 6.4 but finds no GPU"),
                                              (None, None, "built without CUDA")])
def test_cli_refuses_cuda_where_torch_sees_none_instead_of_failing_every_check(monkeypatch, checks_run, capsys, cuda, hip, build):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        assert _cli_error(["doctor", "--no-comfyui", "--device", device], capsys) == (
            f"--device {device}: torch sees no CUDA device here (torch {torch.__version__} {build}); "
            "drop --device to check this machine's CPU")
    assert checks_run == []


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")
def test_cli_refuses_another_device_type_torch_cannot_place_a_tensor_on(checks_run, capsys):
    error = _cli_error(["doctor", "--no-comfyui", "--device", "mps"], capsys)
    assert error.startswith("--device mps: torch cannot place a tensor there (NotImplementedError: Could not run")
    assert error.endswith("); drop --device to check this machine's CPU")
    assert checks_run == []


def test_cli_refuses_a_cuda_index_past_the_gpus_torch_sees(monkeypatch, checks_run, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _cli_error(["doctor", "--no-comfyui", "--device", "cuda:1"], capsys) == (
        "--device cuda:1: torch sees no such CUDA device here, only cuda:0; give one of them or drop --device")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "only cuda:0 to cuda:1;" in _cli_error(["doctor", "--no-comfyui", "--device", "cuda:2"], capsys)
    assert checks_run == []


def test_the_node_s_torch_device_and_the_cli_s_text_run_the_checks(checks_run):
    """SDOptDoctor passes ComfyUI's torch.device, the CLI its --device text."""
    doctor.run_checks(CPU)
    doctor.run_checks("cpu")
    assert checks_run == [CPU, CPU]


def test_a_node_check_that_raises_costs_only_its_own_rows(monkeypatch):
    def broken_graph_rows(ctx):
        raise RuntimeError("capture probe broke")

    monkeypatch.setattr(doctor, "NODE_CHECKS", tuple((name, broken_graph_rows if "CUDA Graph" in name else check) for name, check in doctor.NODE_CHECKS))
    monkeypatch.setattr(doctor, "CHECKS", (("device", doctor.check_device), *doctor.NODE_CHECKS))
    rows = {r.check: r for r in doctor.run_checks("cpu")}
    assert rows["node: sdopt CUDA Graph and Offload"].status == FAILED
    assert "capture probe broke" in rows["node: sdopt CUDA Graph and Offload"].result
    for node in ("sdopt Precision", "sdopt Attention", "sdopt Compile", "sdopt Tiled VAE", "sdopt Profiler"):
        assert f"node: {node}" in rows, node
