"""``python -m sdopt doctor``: the table printed and the rows written as JSON, exit status 1 where a check
failed, a --device torch cannot use refused before any check runs, and a --comfyui folder that is no
ComfyUI reported as such; the checks run on the node's torch.device as on the CLI's --device text. The
checks themselves are tested in tests/unit/nodes/checks."""
import json
import sys

import pytest
import torch

from sdopt.nodes.checks import OK, STATUSES, CheckRow, check_cuda_graph, check_device, run_checks
from sdopt.nodes.checks import device as device_checks, run
from sdopt.tools.cli import main
from sdopt.tools.doctor import load_comfyui

CPU = torch.device("cpu")


def test_load_comfyui_reports_a_folder_that_is_no_comfyui(tmp_path):
    info = load_comfyui(tmp_path)
    assert info.error and "ComfyUI not found" in info.error
    assert load_comfyui(None) is None
    assert "comfy" not in sys.modules


def test_cli_prints_the_table_and_writes_one_json_object_per_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run, "CHECKS", (("device", check_device), ("CUDA graph", check_cuda_graph)))
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

    monkeypatch.setattr(device_checks, "_run_on_device", no_kernel)
    monkeypatch.setattr(run, "CHECKS", (("device", check_device),))
    assert main(["doctor", "--no-comfyui", "--device", "cpu"]) == 1
    assert "| device | failed |" in capsys.readouterr().out


@pytest.fixture
def checks_run(monkeypatch):
    """The devices the (one, recording) check ran on."""
    devices = []

    def record(ctx):
        devices.append(ctx.device)
        return [CheckRow("device", "recorded the device", OK, str(ctx.device))]

    monkeypatch.setattr(run, "CHECKS", (("device", record),))
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
    run_checks(CPU)
    run_checks("cpu")
    assert checks_run == [CPU, CPU]
