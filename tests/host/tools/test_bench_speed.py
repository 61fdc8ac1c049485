"""bench speed inside ComfyUI, on the mini checkpoint at 64 px: stock first as the reference, every
requested rung measured in interleaved rounds, its image checked against its eager twin's, a
profiled prompt per rung, and the CLI's JSON, plot and traces; --isolate's rung in a process of its own."""
import json

import pytest
import torch

from sdopt.measure.step_profile import step_category_table, step_profile_table
from sdopt.tools.bench_speed import bench_speed, speed_table, step_profiles
from sdopt.tools.cli import main


@pytest.fixture(scope="module")
def rows(comfy_host):
    return bench_speed(comfy_host.host.path, str(comfy_host.checkpoint), size=64, steps=3, rounds=2,
                       rungs=["trace", "graph", "cache", "EasyCache"], progress=False, profile=True)


def test_stock_first_then_the_rungs_each_measured_every_round(rows, comfy_host):
    assert [r.rung for r in rows] == ["stock", "trace", "graph", "cache", "EasyCache"]
    assert {(r.memory_mode, r.peak_outside_allocator_bytes is None) for r in rows} == {
        (comfy_host.host.memory_mode.label, not comfy_host.host.memory_mode.dynamic)}, "the process's memory mode, on every row"
    stock = rows[0]
    assert stock.speedup_median == stock.speedup_min == stock.speedup_max == 1.0 and stock.max_pixel_diff == 0
    for row in rows:
        assert len(row.rounds_it_per_s) == 2 and row.steady_it_per_s > 0 and row.peak_memory_bytes > 0
        assert row.sampler_s > 0 and row.decode_s > 0 and row.end_to_end_s == pytest.approx(row.sampler_s + row.decode_s)


def test_rungs_say_what_ran(rows):
    trace, graph = rows[1], rows[2]
    assert "Compile(trace)" in trace.nodes and "SDOptCompile: trace: 1 input signature(s)" in trace.notes
    assert "CUDA graphs need a CUDA device" in graph.notes


def test_traced_and_graphed_images_keep_to_their_eager_twin(rows):
    stock, trace, graph, *_ = rows
    assert stock.eager_twin == "" and stock.within_tolerance is None and stock.max_pixel_diff_vs_eager is None
    assert trace.eager_twin == graph.eager_twin == "attention"
    assert trace.within_tolerance and graph.within_tolerance
    assert graph.max_pixel_diff_vs_eager == 0, "on a CPU the graph node passes through: its image is its twin's"
    table = speed_table(rows)
    assert "— (eager)" in table and table.count(" ok (attention)") == 2 and "tolerance: at most 16 levels" in table


def test_step_caches_give_their_difference_from_the_uncached_twin_unjudged(rows):
    cache, easycache = rows[3:]
    assert (cache.eager_twin, easycache.eager_twin) == ("attention", "stock")
    for row in (cache, easycache):
        assert row.within_tolerance is None and row.psnr_vs_eager_db is not None and row.psnr_vs_eager_db > 0
    assert "1 of 3 calls ran the whole UNet, 2 reused deep features" in cache.notes
    assert cache.max_pixel_diff_vs_eager > 0, "reused deep features change the image of a 3-step run"
    assert "dB (approximate by design: not held to the tolerance; attention)" in speed_table(rows)


def test_each_rung_has_a_step_profile_beside_its_steady_step(rows):
    for row in rows:
        step = row.step_profile
        assert step["wall_ms"] == pytest.approx(1000 / row.steady_it_per_s)
        assert 0 < step["busy_ms"] and 0 < step["busy_share"] <= 1 and step["bound_by"] in ("ops", "Python")
        assert step["activities_per_step"] > 100 and any(name.startswith("aten::") for name, _ in step["top"])
    for row in rows[:3:2]:  # stock and graph; the trace's shape arithmetic reads CPU scalars
        assert row.step_profile["host_syncs"] < 3, "ComfyUI's step loop reads no tensor value: only its set-up does"
    table = step_profile_table(step_profiles(rows))
    assert table.count("\n") == len(rows) + 1 and "aten ops per step" in table
    for row in rows:
        shares = dict(row.step_profile["categories"])
        assert sum(shares.values()) == pytest.approx(1.0) and shares["matmul"] > 0
        assert row.step_profile["outside_graphs"] is None, "no rung here runs a compiled graph"
    assert step_category_table(step_profiles(rows)).count("no compiled graph") == len(rows)


def test_cli_rejects_unknown_rungs_and_writes_json_and_plot(comfy_host, tmp_path, capsys):
    argv = ["bench", "speed", "--comfyui", str(comfy_host.host.path), "--model", str(comfy_host.checkpoint)]
    assert main(argv + ["--rungs", "warp"]) == 2
    assert "--rungs: unknown warp" in capsys.readouterr().err
    out, plot = tmp_path / "speed.json", tmp_path / "speed.png"
    assert main(argv + ["--size", "64", "--steps", "2", "--rounds", "1", "--rungs", "precision", "--json", str(out), "--plot", str(plot),
                        "--trace-dir", str(tmp_path / "traces")]) == 0
    assert [row["rung"] for row in json.loads(out.read_text())] == ["stock", "precision"]
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["precision.trace.json.gz", "stock.trace.json.gz"]
    assert "value reads while sampling" in capsys.readouterr().out
    assert plot.stat().st_size > 1000


def test_the_auto_rung_decides_once_and_reuses_its_stack_at_every_later_prompt(comfy_host):
    """Each rung's prompts sample one profiled model, as a server keeps a Profiler's output between prompts:
    with a new Profiler clone per prompt Auto decided and compiled again at every prompt (0.55x stock where
    its stack wired by hand ran 0.92x, 2026-12-08)."""
    rows = bench_speed(comfy_host.host.path, str(comfy_host.checkpoint), size=64, steps=2, rounds=2, rungs=["auto"],
                       progress=False)
    auto = rows[1]
    assert auto.rung == "auto" and "SDOptAuto: " in auto.notes
    assert "reused the stack chosen for 1x4x8x8" in auto.notes and "decided for" not in auto.notes, auto.notes


def test_sdxl_mini_samples_with_its_y_vector(comfy_host, sdxl_checkpoint):
    """SDXL's UNet refuses a call without ``y``: stock and the precision rung sampling at all is the check."""
    rows = bench_speed(comfy_host.host.path, str(sdxl_checkpoint), size=64, steps=2, rounds=1, rungs=["precision"], progress=False)
    assert [r.rung for r in rows] == ["stock", "precision"]
    assert all(r.steady_it_per_s > 0 and r.decode_s > 0 for r in rows)
    assert "SDOptPrecision" in rows[1].notes


def test_isolate_runs_the_rung_in_a_process_of_its_own(comfy_host):
    """The child path end to end: the pack run as a module, rows back through JSON. That each child's
    compiler caches are its own is checked by the unit tier (a real child interpreter reads the
    variables); a cold compile here would cost CI a minute."""
    from sdopt.tools.bench_speed import bench_speed_isolated

    rows = bench_speed_isolated(comfy_host.host.path, model=str(comfy_host.checkpoint), size=64, steps=2, rounds=1,
                                rungs=["precision"], progress=False)
    assert [(row.rung, row.isolated) for row in rows] == [("stock", True), ("precision", True)]
    assert rows[1].notes.startswith("SDOptPrecision") and rows[1].rounds_it_per_s


def test_fp8_rungs_sdopts_matmuls_beside_comfyuis_own_fp8_fast(comfy_host, monkeypatch):
    """SD3.5's mini (its blocks are Linear layers): Precision's fp8_matmul against its half-precision twin, and
    ComfyUI's fp8_e4m3fn_fast loaded as Load Diffusion Model loads it, against stock; each row says what ran.
    ComfyUI runs no fp8 matmul on a CPU, so its row says so; with its supports_fp8_compute faked to yes it
    builds its fp8 layers, which is what a GPU of compute capability 8.9+ runs."""
    import comfy.model_management
    import comfy.ops

    from sdopt.tools import bench_speed as bench

    host = comfy_host.family("sd35")
    rows = bench_speed(comfy_host.host.path, str(host.checkpoint), size=64, steps=2, rounds=1,
                       rungs=["fp8_matmul", "fp8_e4m3fn_fast"], progress=False)
    assert [r.rung for r in rows] == ["stock", "fp8_matmul", "fp8_e4m3fn_fast"]
    fp8, comfys = rows[1:]
    assert (fp8.eager_twin, comfys.eager_twin) == ("attention", "stock")
    assert "through torch._scaled_mm's fp32 emulation" in fp8.notes and comfys.nodes == "Load Diffusion Model(fp8_e4m3fn_fast)"
    assert comfys.notes == "ComfyUI runs no fp8 matmul on cpu (its supports_fp8_compute says no): fp8 weights upcast per layer to fp32"
    for row in (fp8, comfys):
        assert row.within_tolerance is None and row.psnr_vs_eager_db is not None and row.max_pixel_diff_vs_eager > 0

    monkeypatch.setattr(comfy.model_management, "supports_fp8_compute", lambda device=None: True)
    base = host.load_checkpoint()[0]
    rung = bench._comfy_fp8_fast(base, host.checkpoint)
    assert rung.note == "ComfyUI's fp8 matmuls (activations clamped at ±448), the rest in fp32"
    linears = [m for m in rung.model.model.diffusion_model.modules() if isinstance(m, comfy.ops.manual_cast.Linear)]
    assert linears and all(isinstance(m, comfy.ops.fp8_ops.Linear) and m.weight.dtype == torch.float8_e4m3fn for m in linears)
