"""``python -m sdopt soak --chaos`` with 5 prompts against a real ComfyUI server it starts itself: every
prompt succeeds, the two it cancels (while sampling and while decoding) after being queued again, the
malformed copy is refused, memory freed during a prompt leaves it whole, every image equals a fresh
server's, both RSS readings are taken, the JSON says so, and the servers and the pack's link are gone
after. The plain soak is the same run without the disruptions and the second server."""
import json
import os
from pathlib import Path

import pytest

from sdopt.tools.cli import main
from sdopt.tools.serve import LINK_NAME
from sdopt.tools.soak import SOAK_NODES, SoakModel, plan_prompt


# Seed 37's first five prompts: cancelled while sampling, cancelled while decoding, /free while sampling,
# after a malformed copy (a value out of range); two of them compile.
SEED = 37


def test_chaos_soak_of_five_prompts_has_no_failure(tmp_path, capsys):
    comfyui = os.environ.get("COMFYUI_PATH")
    if not comfyui:
        pytest.skip("host tier: COMFYUI_PATH is not set (point it at a ComfyUI checkout to run these)")
    checkpoints = Path(os.environ.get("SDOPT_TEST_MODELS") or tmp_path / "checkpoints")
    checkpoints.mkdir(parents=True, exist_ok=True)
    models = tmp_path / "models"
    models.mkdir()
    (models / "checkpoints").symlink_to(checkpoints.resolve(), target_is_directory=True)
    link = Path(comfyui) / "custom_nodes" / LINK_NAME
    linked_before = link.is_symlink() or link.exists()
    report = tmp_path / "soak.json"

    # The drift of 5 prompts is noise; the 100-prompt soak holds the 5% target (docs/benchmarks.md). No
    # warm-up: it would start with a compile and a trace (45 s of CI), which the unit tests plan.
    status = main(["soak", "--chaos", "--prompts", "5", "--warmup", "0", "--seed", str(SEED), "--model", "mini", "--comfyui", comfyui,
                   "--models", str(models), "--max-drift", "50", "--json", str(report)])
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["failed"] == 0, "\n".join(data["problems"]) + "\n" + out
    assert status == 0 and data["passed"], out
    assert data["run"] == 5 and [o["status"] for o in data["outcomes"]] == ["success"] * 5
    assert data["rss_warm_bytes"] > 0 and data["rss_end_bytes"] > 0 and data["drift"] is not None
    assert data["command"].startswith("python -m sdopt soak --chaos --prompts 5")
    assert [o["chain"] for o in data["outcomes"]] == [
        plan_prompt(index, SEED, {"sdopt-mini-sd15.safetensors": SoakModel("sdopt-soak-mini-lora.safetensors")}, 0).describe()
        for index in range(5)]
    chaos = data["chaos"]
    assert chaos["events"] == ["prompt 1: interrupted while sampling, then queued again", "prompt 2: interrupted while decoding, then queued again",
                               "prompt 3: POST /free during it", "prompt 4: after a malformed copy (value out of range)"], chaos["events"]
    assert chaos["accepted_malformed"] == [] and chaos["unanswered"] == []
    assert [d["index"] for d in chaos["differences"]] == list(range(5)) and all(d["within"] for d in chaos["differences"]), chaos["differences"]
    assert all(name.removeprefix("SDOpt") in out for name in SOAK_NODES), "5 prompts use every node"
    assert sum(line.startswith("prompt ") for line in out.splitlines()) == 5 and "\x1b[" not in out
    assert (link.is_symlink() or link.exists()) == linked_before
