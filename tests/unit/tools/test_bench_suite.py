"""bench suite: the plan (every phase the GPU must show, tiny in a dry run), its time budget, and the
runner that keeps every finished phase when a later one fails, times out or does not fit."""
import json
import tarfile

import pytest
import torch

from sdopt.errors import UserError
from sdopt.tools import bench_suite
from sdopt.tools.bench_suite import child, runner
from sdopt.tools.bench_suite import phases as suite_phases
from sdopt.tools.bench_suite import (
    DONE, FAILED, PHASE_LIMIT_S, SKIPPED, SUITE_LIMIT_S, TIMED_OUT, Phase, check_budget, over_budget, plan_phases, run_suite,
    select, write_archive, write_suite,
)


@pytest.fixture
def sdxl_known(monkeypatch):
    monkeypatch.setattr(suite_phases, "_sdxl_known", lambda model: True)


def by_name(phases):
    return {phase.name: phase for phase in phases}


def test_the_plan_has_every_phase_the_gpu_must_show(sdxl_known):
    phases = plan_phases()
    assert [p.number for p in phases] == list(range(1, 15))
    named = by_name(phases)
    assert list(named) == ["gpu-tests", "doctor", "speed", "competitors", "speed-sdxl", "attention", "vae", "res-8gib", "res-4gib",
                           "res-2gib", "offload", "cache", "flux-12gib", "diffusers-compile"]
    speed = named["speed"].options
    assert (speed["model"], speed["size"], speed["steps"]) == ("full", 512, 20)
    assert "compile+graph+channels_last" in speed["rungs"] and "stock" in speed["rungs"] and not speed["skip_rungs"]
    assert {"stock", "TorchCompileModel", "diffusers"} <= set(named["competitors"].options["rungs"])
    assert named["diffusers-compile"].options["rungs"] == ["stock", "diffusers+compile"]
    assert named["speed-sdxl"].options["model"] == "sdxl-full" and not named["speed-sdxl"].skip
    assert {"compile+graph", "compile+graph+cache", "compile+graph+EasyCache"} <= set(named["cache"].options["rungs"])
    assert [named[f"res-{cap}gib"].options["vram_cap_gib"] for cap in (8, 4, 2)] == [8, 4, 2]
    assert 4096 in named["res-8gib"].options["sizes"] and 2048 in named["res-2gib"].options["sizes"]
    assert named["attention"].options["dtype"] == "fp16" and named["vae"].options["sizes"][-1] == 4096
    flux = named["flux-12gib"].options
    assert flux["model"] == "flux-full" and [cap for _, _, cap in flux["modes"]] == [None, 12], "the uncapped run is the reference"
    assert all(not p.skip for p in phases)


def test_each_phase_fits_nine_minutes_and_the_suite_forty(sdxl_known):
    phases = plan_phases()
    check_budget(phases)
    assert max(p.budget_s for p in phases) <= PHASE_LIMIT_S == 9 * 60
    assert sum(p.budget_s for p in phases) <= SUITE_LIMIT_S == 40 * 60


def test_the_budget_check_refuses_a_long_phase_or_a_long_suite():
    with pytest.raises(ValueError, match="phase 3 .* above the 540 s"):
        check_budget([Phase(3, "x", "x", "run_doctor", PHASE_LIMIT_S + 1)])
    eight = [Phase(n, f"p{n}", "p", "run_doctor", 5 * 60) for n in range(1, 10)]
    with pytest.raises(ValueError, match="2700 s together"):
        check_budget(eight)
    check_budget(eight[:8])
    check_budget([*eight[:8], Phase(9, "later", "p", "run_doctor", 5 * 60, skip="not yet")])


def test_the_sdxl_phase_waits_for_its_model(monkeypatch):
    monkeypatch.setattr(suite_phases, "_sdxl_known", lambda model: False)
    sdxl = by_name(plan_phases(sdxl_model="sdxl-full"))["speed-sdxl"]
    assert sdxl.skip.startswith("bench speed has no sdxl-full model yet")


def test_dry_run_is_the_same_plan_at_tiny_sizes_and_says_what_it_leaves_out(sdxl_known):
    full, dry = plan_phases(), plan_phases(dry_run=True)
    assert [(p.number, p.name, p.runner) for p in dry] == [(p.number, p.name, p.runner) for p in full]
    named = by_name(dry)
    assert named["speed"].options["model"] == "mini" and named["speed"].options["size"] == 64
    assert named["speed"].options["rungs"] == full[2].options["rungs"]
    assert set(named["speed"].options["skip_rungs"]) == {"compile", "compile+graph", "compile+graph+channels_last", "TorchCompileModel", "precision"}
    assert named["offload"].options["modes"] == [("none", 0, None), ("sequential", 0, None)]
    assert len(by_name(full)["offload"].options["modes"]) == 5
    assert named["flux-12gib"].skip and "dry run" in named["flux-12gib"].skip
    assert "diffusers+compile" in named["diffusers-compile"].options["skip_rungs"]
    assert named["diffusers-compile"].skip and "dry run" in named["diffusers-compile"].skip
    assert all("minute" in why for why in named["competitors"].options["skip_rungs"].values())
    assert "precision" not in named["competitors"].options["skip_rungs"]
    assert max(max(p.options.get("sizes", [0])) for p in dry) <= 256
    assert named["attention"].options["device"] == "cpu" and named["vae"].options["model"] == "tiny"
    assert named["speed-sdxl"].skip and "dry run" in named["speed-sdxl"].skip
    assert named["res-4gib"].skip and "dry run" in named["res-4gib"].skip and not named["res-2gib"].skip
    assert plan_phases(model="full", dry_run=True)[2].options["model"] == "full"


def test_a_phase_that_would_pass_the_suite_budget_waits_for_its_own_run():
    phase = Phase(8, "res-8gib", "t", "run_resolutions", 240)
    assert over_budget(phase, elapsed_s=SUITE_LIMIT_S - 300) == ""
    why = over_budget(phase, elapsed_s=SUITE_LIMIT_S - 200)
    assert "--phase 8" in why and "4.0 min" in why


def test_select_phases_by_number():
    phases = plan_phases()
    assert [p.name for p in select(phases, [2, 7])] == ["doctor", "vae"]
    # the order given, not the phase numbers': a short lease runs what matters first
    assert [p.number for p in select(phases, [12, 8, 12])] == [12, 8]
    assert select(phases, None) == phases
    with pytest.raises(UserError, match="--phase 15: choose from 1 \\(gpu-tests\\)"):
        select(phases, [15])


def test_a_failing_or_late_phase_keeps_the_phases_before_it(tmp_path):
    good = Phase(6, "attention", "attention", "run_attention", 60, {"tokens": [16], "dtype": "fp32", "device": "cpu"})
    broken = Phase(7, "vae", "vae", "run_attention", 60, {"tokens": [0], "dtype": "fp32", "device": "cpu"})
    late = Phase(8, "res-8gib", "res", "run_resolutions", 240, {})
    outcomes = run_suite(tmp_path, [good, broken, late], limit_s=200, archive=tmp_path / "suite.tgz")
    assert [o.status for o in outcomes] == [DONE, FAILED, SKIPPED]
    assert "exit status" in outcomes[1].error and "must be >= 1" in outcomes[1].error
    assert "--phase 8" in outcomes[2].skipped[0]["why"]
    assert {"06-attention.json", "06-attention.md", "06-attention.png", "06-attention.log"} <= set(outcomes[0].files)
    first = json.loads((tmp_path / "06-attention.json").read_text())
    assert first["status"] == DONE and {r["backend"] for r in first["rows"]} >= {"sdpa", "naive"}
    assert json.loads((tmp_path / "07-vae.json").read_text())["status"] == FAILED
    index = json.loads((tmp_path / "suite.json").read_text())
    assert [(p["number"], p["status"]) for p in index["phases"]] == [(6, DONE), (7, FAILED), (8, SKIPPED)]
    text = (tmp_path / "suite.md").read_text()
    assert "## 6. attention" in text and "## 7. vae" in text and "**failed**" in text and "## 8. res" in text
    with tarfile.open(tmp_path / "suite.tgz") as tar:
        assert {"suite.md", "06-attention.json", "07-vae.log"} <= set(tar.getnames())


def test_a_phase_past_its_time_limit_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "DRY_PHASE_LIMIT_S", 0.2)
    slow = Phase(2, "doctor", "doctor", "run_doctor", 45, {"comfyui": None})
    (outcome,) = run_suite(tmp_path, [slow], dry_run=True)
    assert outcome.status == TIMED_OUT and "0 s, its time limit" in outcome.error
    assert json.loads((tmp_path / "02-doctor.json").read_text())["status"] == TIMED_OUT


def test_a_stopped_phase_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "DRY_PHASE_LIMIT_S", 0.2)
    slow = Phase(8, "res-8gib", "res", "run_doctor", 240, {"comfyui": None})
    bench_suite.write_phase(tmp_path, slow, {"rows": [{"size": 1024}], "skipped": [], "markdown": "| 1024² | done |", "plots": [],
                                             "status": bench_suite.PARTIAL}, 5.0)
    (outcome,) = run_suite(tmp_path, [slow], dry_run=True)
    data = json.loads((tmp_path / "08-res-8gib.json").read_text())
    assert outcome.status == data["status"] == TIMED_OUT and data["rows"] == [{"size": 1024}]
    text = (tmp_path / "08-res-8gib.md").read_text()
    assert "**timed out**" in text and "The 1 row(s) it finished" in text and "| 1024² | done |" in text


def test_the_index_keeps_phases_of_earlier_runs(tmp_path):
    for phase in plan_phases()[:2]:
        bench_suite.write_phase(tmp_path, phase, {"rows": [{"x": 1}], "skipped": [], "markdown": f"{phase.name} table", "plots": []}, 3.0)
    write_suite(tmp_path)
    later = plan_phases()[5]
    bench_suite.write_phase(tmp_path, later, {"rows": [], "skipped": [{"what": "xformers", "why": "not installed"}], "markdown": "", "plots": []}, 1.0)
    write_suite(tmp_path)
    index = json.loads((tmp_path / "suite.json").read_text())
    assert [p["number"] for p in index["phases"]] == [1, 2, 6]
    text = (tmp_path / "suite.md").read_text()
    assert text.index("gpu-tests table") < text.index("doctor table") < text.index("- xformers: not installed")
    write_archive(tmp_path, tmp_path / "out" / "suite.tgz")
    with tarfile.open(tmp_path / "out" / "suite.tgz") as tar:
        assert "suite.md" in tar.getnames()


def test_vae_phase_retries_the_injected_out_of_memory_error(tmp_path):
    phase = by_name(plan_phases(dry_run=True))["vae"]
    result = child.run_vae(tmp_path, replace_options(phase, sizes=[128]))
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"untiled", "tiled", "tiled + injected OOM"}
    retried = rows["tiled + injected OOM"]
    assert retried["oom_retries"] >= 1 and len(retried["tiles_tried"]) >= 2 and retried["tiles_tried"][1] < retried["tiles_tried"][0]
    assert rows["tiled"]["oom_retries"] == 0
    assert retried["psnr_vs_untiled_db"] > 60 and rows["tiled"]["psnr_vs_untiled_db"] > 60
    assert "OOM retries" in result["markdown"]


def test_vae_phase_skips_the_injected_error_where_the_tile_is_already_the_last_resort(tmp_path):
    phase = by_name(plan_phases(dry_run=True))["vae"]
    result = child.run_vae(tmp_path, replace_options(phase, sizes=[128], budget_mb=1))
    assert [row["mode"] for row in result["rows"]] == ["untiled", "tiled"]
    (skip,) = result["skipped"]
    assert skip["what"] == "tiled + injected OOM 128²" and "last resort" in skip["why"] and "nothing smaller to retry" in skip["why"]


def test_injected_oom_raises_as_often_as_asked():
    layer = torch.nn.Linear(2, 2)
    hook = child.InjectedOOM(layer, times=1)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        layer(torch.ones(1, 2))
    layer(torch.ones(1, 2))
    hook.remove()


def replace_options(phase, **options):
    from dataclasses import replace

    return replace(phase, options={**phase.options, **options})


def test_the_index_names_each_reason_once():
    skipped = [{"what": f"test {n}", "why": "GPU tier: CUDA is not available"} for n in range(3)] + [{"what": "xformers", "why": "not installed"}]
    assert bench_suite.skip_summary(skipped) == "3 × GPU tier: CUDA is not available; xformers: not installed"
    assert bench_suite.skip_summary([]) == "—"
