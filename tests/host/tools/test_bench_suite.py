"""``python -m sdopt bench suite --dry-run`` against real ComfyUI, as CI runs it: every phase of the GPU
plan runs at tiny sizes on the CPU, each in its own process, and writes its section, JSON and plots;
what the dry run leaves out is named with the reason."""
import json
import os
import subprocess
import sys

import pytest

from sdopt.tools.bench_suite import DONE, SKIPPED, plan_phases


@pytest.fixture(scope="module")
def dry_run(comfy_host, tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    models = root / "models"
    models.mkdir()
    (models / "checkpoints").symlink_to(comfy_host.models, target_is_directory=True)
    out = root / "out"
    command = [sys.executable, "-m", "sdopt", "bench", "suite", "--dry-run", "--out", str(out), "--models", str(models),
               "--comfyui", str(comfy_host.host.path), "--archive", str(root / "suite.tgz")]
    done = subprocess.run(command, cwd=root, env=os.environ.copy(), capture_output=True, text=True, timeout=1800)
    return done, out, root


def test_every_phase_writes_its_section(dry_run):
    done, out, root = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    index = json.loads((out / "suite.json").read_text())
    statuses = {p["name"]: p["status"] for p in index["phases"]}
    phases = plan_phases(dry_run=True)
    assert list(statuses) == [p.name for p in phases]
    assert (statuses.pop("speed-sdxl") == statuses.pop("res-4gib") == statuses.pop("flux-12gib") == statuses.pop("diffusers-compile")
            == SKIPPED)
    assert set(statuses.values()) == {DONE}, statuses
    text = (out / "suite.md").read_text()
    for phase in phases:
        assert f"## {phase.number}. {phase.title}" in text
        assert (out / f"{phase.stem}.json").exists() and (out / f"{phase.stem}.md").exists()
    for name in ("03-speed", "04-competitors", "06-attention", "07-vae", "08-res-8gib", "11-offload"):
        assert (out / f"{name}.png").stat().st_size > 1000, name
    assert (root / "suite.tgz").stat().st_size > 0


def test_each_phase_measured_what_it_names(dry_run):
    out = dry_run[1]

    def rows(stem):
        return json.loads((out / f"{stem}.json").read_text())

    gpu_tests = rows("01-gpu-tests")
    assert gpu_tests["rows"] and all(r["outcome"] == "skipped" for r in gpu_tests["rows"]), "no CUDA here"
    assert {r["check"] for r in rows("02-doctor")["rows"]} >= {"device", "inductor", "CUDA graph", "ComfyUI"}
    speed = rows("03-speed")
    assert [r["rung"] for r in speed["rows"]] == ["stock", "attention", "trace", "graph"]
    assert {s["what"] for s in speed["skipped"]} >= {"rung compile", "rung compile+graph+channels_last", "rung TorchCompileModel"}
    competitors = {r["rung"]: r for r in rows("04-competitors")["rows"]}
    assert list(competitors) == ["stock", "diffusers"]
    assert competitors["diffusers"]["steady_it_per_s"] > 0
    assert competitors["diffusers"]["max_pixel_diff"] < 16, "the same weights, prompts, noise and schedule give nearly stock's image"
    vae = {(r["size"], r["mode"]): r for r in rows("07-vae")["rows"]}
    assert vae[(128, "tiled + injected OOM")]["oom_retries"] >= 1
    for number, cap, stacks in ((8, 8, {"stock", "sdopt", "auto"}), (10, 2, {"stock", "sdopt"})):
        res = rows(f"{number:02d}-res-{cap}gib")
        assert {r["stack"] for r in res["rows"]} == stacks and res["options"]["vram_cap_gib"] == cap
    offload = rows("11-offload")
    assert [r["mode"] for r in offload["rows"]] == ["none", "sequential"]
    assert all(r["max_pixel_diff_vs_reference"] == 0 for r in offload["rows"]), "on a CPU every mode is a no-op"
    assert offload["rows"][0]["step_time_vs_reference"] == 1.0
    assert offload["skipped"] and "CPU" in offload["skipped"][0]["why"]
    cache = {r["rung"]: r for r in rows("12-cache")["rows"]}
    assert list(cache) == ["stock", "cache", "EasyCache"] and cache["cache"]["psnr_vs_eager_db"] is not None
