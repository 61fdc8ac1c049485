"""``sdopt run`` in real ComfyUI: ``--vram-cap``'s line on stderr and in the report (on a GPU in
force, on a CPU ignored without failing the run), the memory mode in the report and ``--memory-mode
dynamic`` run or refused with its reason, a node's UserError as one line on stderr, and the
host's ``release`` of every model a run left behind."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from sdopt.tools.cli import main


@pytest.fixture
def uncapped_afterwards(comfy_host):
    yield
    comfy_host.host.set_vram_cap(None)


def test_run_with_a_vram_cap_says_so_in_the_report(comfy_host, tmp_path, capsys, uncapped_afterwards):
    report = tmp_path / "report.json"
    sets = [arg for setting in comfy_host.SMALL for arg in ("--set", setting)]
    argv = ["run", str(comfy_host.WORKFLOWS / "sd15_baseline.json"), "--comfyui", str(comfy_host.host.path), *sets,
            "--vram-cap", "2GiB", "--report-json", str(report)]
    assert main(argv) == 0
    if torch.cuda.is_available():
        line = "VRAM capped at 2.00 GiB of "
    else:
        line = "--vram-cap 2.00 GiB ignored: the cap applies to CUDA GPUs only, and this run is on cpu"
    printed = capsys.readouterr()
    assert f"sdopt: {line}" in printed.err
    assert line in printed.out, "the profile table shows the report's notes"
    assert any(line in note for note in json.loads(report.read_text())["notes"])
    assert comfy_host.host.vram_cap_bytes == (2 * 2**30 if torch.cuda.is_available() else None)
    mode = {None: None, False: "classic memory", True: "dynamic VRAM"}[comfy_host.host.memory_mode.dynamic]
    assert json.loads(report.read_text())["memory_mode"] == mode == comfy_host.host.memory_mode.label, (
        "the report names the mode the runner started")


def _expected_refusal(comfyui) -> str | None:
    """Why ``--memory-mode dynamic`` cannot start here, as the runner words it; None where it can."""
    if "def enables_dynamic_vram" not in (comfyui / "comfy" / "cli_args.py").read_text():
        return "this ComfyUI has no dynamic VRAM; use a ComfyUI that offers it"
    if not torch.cuda.is_available():
        return "there is no CUDA device, and dynamic VRAM manages GPU memory; run it on an NVIDIA GPU"
    if importlib.util.find_spec("comfy_aimdo") is None:
        return "comfy-aimdo is not installed; install comfy-aimdo"
    return None


def test_memory_mode_dynamic_runs_under_dynamic_vram_or_says_why_it_cannot(comfy_host, tmp_path):
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "sdopt", "run", str(comfy_host.WORKFLOWS / "sd15_baseline.json"),
        "--comfyui", str(comfy_host.host.path), "--models", str(comfy_host.models), "--out", str(tmp_path / "out"),
        "--memory-mode", "dynamic", "--report-json", str(report), *(arg for setting in comfy_host.SMALL for arg in ("--set", setting)),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    refusal = _expected_refusal(comfy_host.host.path)
    if refusal is None:
        assert done.returncode == 0, done.stderr[-4000:]
        assert json.loads(report.read_text())["memory_mode"] == "dynamic VRAM"
    else:
        assert done.returncode == 2, done.stderr[-4000:]
        assert "Traceback" not in done.stderr, done.stderr[-4000:]
        assert f"sdopt: error: --memory-mode (or $SDOPT_MEMORY_MODE) dynamic: {refusal}" in done.stderr, done.stderr[-4000:]


def test_a_mistake_found_while_running_is_one_line_without_a_traceback(comfy_host, tmp_path):
    command = [
        sys.executable, "-m", "sdopt", "run", str(comfy_host.WORKFLOWS / "sd15_baseline.json"),
        "--comfyui", str(comfy_host.host.path), "--models", str(comfy_host.models), "--out", str(tmp_path / "out"),
        *(arg for setting in [*comfy_host.SMALL, "SDOptProfiler.label="] for arg in ("--set", setting)),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "Exception during processing" not in done.stderr, done.stderr[-4000:]
    assert done.stderr.rstrip().endswith(
        "sdopt: error: node 10 (SDOptProfiler): label: it is empty; give the runs a name, e.g. 'baseline'"
    ), done.stderr[-4000:]


_RELEASE_SCRIPT = """
import gc, json, sys
from sdopt.tools.headless import boot, run_workflow
comfyui, models, workflow, out, *sets = sys.argv[1:]
run_workflow(workflow, comfyui, models, sets, out_dir=out)
import comfy.model_patcher
alive = lambda: sum(isinstance(o, comfy.model_patcher.ModelPatcher) for o in gc.get_objects())
before = alive()
boot(comfyui).release()
print(json.dumps({"before": before, "after": alive()}))
"""


def test_release_drops_every_model_a_run_left_in_comfyui(comfy_host, tmp_path):
    """What a finished run leaves (ComfyUI's cached node outputs, its loaded models) holds ModelPatchers;
    ``release``, which the runner also registers for the interpreter's exit, drops them all."""
    command = [sys.executable, "-c", _RELEASE_SCRIPT, str(comfy_host.host.path), str(comfy_host.models),
               str(comfy_host.WORKFLOWS / "sd15_baseline.json"), str(tmp_path / "out"), *comfy_host.SMALL]
    done = subprocess.run(command, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["before"] > 0, "the run's models are still cached when it returns"
    assert counts["after"] == 0, counts
    assert "Exception ignored" not in done.stderr, done.stderr[-4000:]
