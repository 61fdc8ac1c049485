"""``python -m sdopt doctor`` against real ComfyUI, in a fresh process as a user runs it: the table,
one JSON object per check, ComfyUI's version and memory mode, and every trial really run."""
import json
import os
import subprocess
import sys

from sdopt.nodes.checks import FAILED, OK, STATUSES


def test_doctor_runs_every_check_against_this_comfyui(comfy_host, tmp_path):
    out = tmp_path / "doctor.json"
    command = [sys.executable, "-m", "sdopt", "doctor", "--comfyui", str(comfy_host.host.path), "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())
    assert done.returncode == (1 if any(r["status"] == FAILED for r in rows) else 0), done.stderr[-4000:]
    assert "| check | status | result | fix | tried |" in done.stdout
    assert all(r["status"] in STATUSES and (r["status"] == OK or r["fix"]) for r in rows)
    by_check = {r["check"]: r for r in rows}
    version = (comfy_host.host.path / "comfyui_version.py").read_text().split('"')[1]
    assert by_check["ComfyUI"]["status"] == OK and by_check["ComfyUI"]["result"].startswith(f"{version} at ")
    assert "ComfyUI memory mode" in by_check
    # The trials ran: their results carry what only running them gives.
    assert "relative error" in by_check["bf16 compute"]["result"]
    assert "against naive" in by_check["attention: sdpa"]["result"]
    inductor = by_check["inductor"]
    assert inductor["status"] != OK or "compiled and ran in" in inductor["result"]
    assert "entr" in by_check["compile cache"]["result"]
    assert not [r for r in rows if "the check itself raised" in r["result"]]
