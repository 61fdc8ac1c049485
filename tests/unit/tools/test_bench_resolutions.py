"""bench resolutions without ComfyUI: which cells run, what the planner's figures add up to, the
table, the JSON rows and the heatmap. The host tier runs the bench in ComfyUI."""
import json
import math
from dataclasses import replace

import pytest

from sdopt.measure.profiler import MEMORY_VRAM
from sdopt.tools import bench_resolutions as bench
from sdopt.tools.cli import main
from sdopt.tools.plan import StagePrediction, UNET_STEP, VAE_DECODE

MiB = 2**20


class FixedPlanner:
    """Stands in for tools.plan's Planner (which traces diffusers models): fixed working peaks per
    (stage, setting), in MiB, and 1 MiB of inputs per stage."""

    def __init__(self, peaks_mib: dict, unet_mib: int = 1600, vae_mib: int = 160):
        self.weights = {"text_encoder": 235 * MiB, "unet": unet_mib * MiB, "vae": vae_mib * MiB}
        self.streamed_unet_bytes = 90 * MiB
        self._peaks = peaks_mib
        self.asked = []

    def predict(self, stage, setting, width, height):
        self.asked.append((stage, setting.name, width, height))
        return StagePrediction(stage, setting.name, max(width, height), self._peaks[stage, setting.name] * MiB,
                               MiB, 0, "op")


PEAKS = {
    (UNET_STEP, "sdpa, CFG batch 2"): 3000,
    (UNET_STEP, "low memory 256 MiB, sdpa"): 700,
    (VAE_DECODE, "untiled, sdpa"): 5000,
    (VAE_DECODE, "tiled 512 px"): 900,
    (VAE_DECODE, "tiled 256 px"): 400,
}


def test_stock_cell_adds_what_is_allocated_weights_inputs_and_the_larger_stage():
    planner = FixedPlanner(PEAKS)
    cell = bench.predict_cell(planner, bench.STOCK, 1024, 10 * MiB, 8192 * MiB, weights_on_device=True)
    assert cell.peak_bytes == (10 + 160 + 1 + 5000) * MiB  # the untiled decode beats the UNet step's 10 + 1600 + 1 + 3000
    assert cell.settings == "sdpa, CFG batch 2; VAE untiled, sdpa" and not cell.low_memory
    assert {(stage, w) for stage, _, w, _ in planner.asked} == {(UNET_STEP, 1024), (VAE_DECODE, 1024)}


def test_sdopt_cell_keeps_the_offload_budget_of_unet_weights_and_the_first_vae_tile_that_fits():
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, 1500 * MiB, weights_on_device=True)
    # UNet: 1024 of its 1600 MiB resident, + 1 + 700; VAE: untiled (160 + 1 + 5000) is over, 512 px tiles fit.
    assert cell.peak_bytes == max(1024 + 1 + 700, 160 + 1 + 900) * MiB
    assert cell.settings == "low memory 256 MiB, sdpa; VAE tiled 512 px; Offload budget 1,024 MiB"
    assert cell.low_memory and cell.offload_mb == 1024
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, 1000 * MiB, weights_on_device=True)
    assert "VAE tiled 256 px" in cell.settings and cell.peak_bytes == (1024 + 1 + 700) * MiB


def test_sdopt_cell_with_sequential_offload_holds_only_the_streamed_layers():
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, 1000 * MiB, weights_on_device=True, offload_mb=0)
    assert cell.peak_bytes == max(90 + 1 + 700, 160 + 1 + 400) * MiB
    assert cell.settings.endswith("; Offload sequential") and cell.offload_mb == 0
    assert "Offload(sequential)" in bench.stack_chains(0)[bench.SDOPT]
    assert "Offload(budget 512 MiB)" in bench.stack_chains(512)[bench.SDOPT]


def test_when_needed_the_sdopt_step_runs_without_low_memory_where_it_fits():
    when_needed = dict(weights_on_device=True, low_memory=bench.LOW_MEMORY_WHEN_NEEDED)
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, 4500 * MiB, **when_needed)
    assert cell.settings.startswith("sdpa, CFG batch 2; VAE tiled 512 px") and cell.peak_bytes == (1024 + 1 + 3000) * MiB
    assert not cell.low_memory
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, 4000 * MiB, **when_needed)
    assert cell.settings.startswith("low memory 256 MiB, sdpa; VAE tiled 512 px") and cell.peak_bytes == (1024 + 1 + 700) * MiB
    assert cell.low_memory
    assert "where the step is predicted not to fit" in bench.stack_chains(1024, bench.LOW_MEMORY_WHEN_NEEDED)[bench.SDOPT]


def test_auto_offload_keeps_what_the_planners_budget_leaves_beside_each_setting():
    auto = dict(weights_on_device=True, low_memory=bench.LOW_MEMORY_WHEN_NEEDED, offload_mb=None)
    # 4000 MiB less 100 allocated, less the plain step's 1 + 3000 x 1.2: 299 MiB resident, more than the
    # 90 streamed, so the plain step keeps 299 MiB and fits (100 + 299 + 1 + 3000 = 3400).
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 100 * MiB, 4000 * MiB, **auto)
    assert not cell.low_memory and cell.offload_mb == 299 and cell.peak_bytes == (100 + 299 + 1 + 3000) * MiB
    assert cell.settings.endswith("; Offload budget 299 MiB")
    # 3700 MiB leaves the plain step no more than the streamed layers, and streamed it still fits
    # (100 + 90 + 1 + 3000): sequential offload, without Low Memory.
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 100 * MiB, 3700 * MiB, **auto)
    assert not cell.low_memory and cell.offload_mb == 0
    # In 3000 MiB the plain step does not fit even streamed: Low Memory, with the whole UNet resident
    # (1600 MiB; the budget leaves 3000 - 100 - 1 - 840).
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 100 * MiB, 3000 * MiB, **auto)
    assert cell.low_memory and cell.offload_mb == 1600 and cell.peak_bytes == (100 + 1600 + 1 + 700) * MiB
    # Where even Low Memory's step leaves no more than the streamed layers: sequential.
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 100 * MiB, 1000 * MiB, **auto)
    assert cell.low_memory and cell.offload_mb == 0 and cell.settings.endswith("; Offload sequential")
    assert "budget_mb from the planner" in bench.stack_chains(None)[bench.SDOPT]


def test_an_auto_cell_is_gated_on_the_least_auto_can_choose():
    """Auto decides at run time; the bench lets its cell run where sdopt's stack with Low Memory when needed
    and the planner's Offload fits, whatever budget is given for the hand-wired sdopt stack."""
    for budget in (1500, 8192):
        auto = bench.predict_cell(FixedPlanner(PEAKS), bench.AUTO, 1024, 0, budget * MiB, weights_on_device=True)
        least = bench.predict_cell(FixedPlanner(PEAKS), bench.SDOPT, 1024, 0, budget * MiB, weights_on_device=True,
                                   offload_mb=None, low_memory=bench.LOW_MEMORY_WHEN_NEEDED)
        assert auto == least
    roomy = bench.predict_cell(FixedPlanner(PEAKS), bench.AUTO, 1024, 0, 8192 * MiB, weights_on_device=True)
    assert not roomy.low_memory and roomy.settings.startswith("sdpa, CFG batch 2;"), "plain where the step fits"


def test_on_a_cpu_the_weights_are_already_in_what_is_allocated():
    cell = bench.predict_cell(FixedPlanner(PEAKS), bench.STOCK, 1024, 2000 * MiB, 16000 * MiB, weights_on_device=False)
    assert cell.peak_bytes == (2000 + 1 + 5000) * MiB


def test_cells_predicted_over_budget_run_only_when_confirmed_on_a_gpu():
    assert bench.should_run(100, 100, confirm=False, on_gpu=False)
    assert not bench.should_run(101, 100, confirm=False, on_gpu=True)
    assert bench.should_run(101, 100, confirm=True, on_gpu=True)
    assert not bench.should_run(101, 100, confirm=True, on_gpu=False), "never on a CPU: the OOM killer, not an exception"


def _row(size, stack, status, seconds=None, peak=None, predicted=1000, budget=8192, **extra):
    return bench.ResolutionRow(
        size=size, stack=stack, status=status, predicted_peak_bytes=predicted * MiB, budget_bytes=budget * MiB,
        predicted_settings="s", model="sdopt-full-sd15", steps=4, device="cuda:0", memory_kind=MEMORY_VRAM,
        seconds=seconds, sampler_s=seconds and seconds * 0.8, decode_s=seconds and seconds * 0.2,
        peak_memory_bytes=peak and peak * MiB, vram_cap_bytes=8192 * MiB, **extra)


ROWS = [
    _row(1024, "stock", "ok", 2.5, 3000, predicted=3100),
    _row(1024, "sdopt", "ok", 3.5, 1800, predicted=1900, psnr_vs_stock_db=72.25,
         notes="SDOptOffload: budget 1,024 MiB: 1,024.0 of 1,640.0 MiB of weights resident"),
    _row(2048, "stock", "predicted OOM", predicted=12000),
    _row(2048, "sdopt", "out of memory", predicted=9000, notes="CUDA out of memory. Tried to allocate 2.00 GiB"),
]


def test_table_puts_stock_beside_sdopt_per_size_and_says_why_cells_did_not_run():
    table = bench.resolutions_table(ROWS)
    assert "sdopt-full-sd15 on cuda:0, 4 steps, VRAM capped at 8,192.0 MiB" in table
    lines = [line for line in table.splitlines() if line.startswith("| 1024") or line.startswith("| 2048")]
    assert lines[0] == ("| 1024x1024 | 2.50 | 3,000.0 | ok | 3,100.0 ≤ 8,192.0 | 3.50 | 1,800.0 | ok | 1,900.0 ≤ 8,192.0 "
                        "| 72.2 |")
    assert lines[1] == ("| 2048x2048 | — | - | predicted OOM | 12,000.0 > 8,192.0 | — | - | out of memory "
                        "| 9,000.0 > 8,192.0 | — |")
    assert "- sdopt at 1024 px: SDOptOffload: budget 1,024 MiB" in table
    assert "- sdopt at 2048 px: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB" in table
    dynamic = bench.resolutions_table([replace(row, memory_mode="dynamic VRAM") for row in ROWS])
    assert "sdopt-full-sd15 on cuda:0 (dynamic VRAM), 4 steps, VRAM capped" in dynamic


def test_table_gives_both_stacks_against_the_uncapped_image_when_measured():
    rows = [replace(ROWS[0], psnr_vs_uncapped_db=math.inf), replace(ROWS[1], psnr_vs_uncapped_db=48.04), *ROWS[2:]]
    table = bench.resolutions_table(rows)
    assert "| PSNR vs uncapped stock dB: stock / sdopt |" in table
    lines = [line for line in table.splitlines() if line.startswith("| 1024") or line.startswith("| 2048")]
    assert lines[0].endswith("| 72.2 | identical / 48.0 |") and lines[1].endswith("| — | — / — |")
    assert "uncapped" not in bench.resolutions_table(ROWS), "no column where nothing was measured"


AUTO_ROWS = [
    _row(1024, "auto", "ok", 1.5, 3200, predicted=3100, psnr_vs_stock_db=math.inf, auto_goal="fastest",
         notes="SDOptAuto: stack fast: Precision(auto) → Attention(sdpa) → Compile(compile) → CUDA Graph"),
    _row(2048, "auto", "ok", 9.0, 7000, predicted=7500, psnr_vs_stock_db=40.5, auto_goal="fastest",
         notes="SDOptAuto: stack low memory 256 MiB + offload 2,048 MiB"),
]


def test_table_gives_auto_its_own_columns_and_what_it_chose_at_each_size():
    table = bench.resolutions_table(ROWS + AUTO_ROWS)
    header = next(line for line in table.splitlines() if line.startswith("| size"))
    assert header.endswith("| auto s | auto peak MiB VRAM | auto status | auto predicted / budget MiB "
                           "| sdopt PSNR vs stock dB | auto PSNR vs stock dB |")
    lines = [line for line in table.splitlines() if line.startswith("| 1024") or line.startswith("| 2048")]
    assert lines[0].endswith("| 1.50 | 3,200.0 | ok | 3,100.0 ≤ 8,192.0 | 72.2 | identical |")
    assert lines[1].endswith("| 9.00 | 7,000.0 | ok | 7,500.0 ≤ 8,192.0 | — | 40.5 |")
    rule = next(line for line in table.splitlines() if line.startswith("| ---"))
    assert rule.count("---:") == 3 * 3 + 2, "times, peaks, predictions and PSNRs right-aligned"
    assert "- **auto**: Auto(goal fastest) on the model and the VAE" in table
    assert "- auto at 1024 px: SDOptAuto: stack fast" in table and "- auto at 2048 px: SDOptAuto: stack low memory" in table
    assert "auto s" not in bench.resolutions_table(ROWS) and "**auto**" not in bench.resolutions_table(ROWS), "none where it did not run"


def test_heatmap_has_a_row_per_stack(tmp_path):
    pytest.importorskip("matplotlib")
    two, three = tmp_path / "two.png", tmp_path / "three.png"
    assert bench.save_heatmap(ROWS, two) is None and bench.save_heatmap(ROWS + AUTO_ROWS, three) is None
    from PIL import Image

    assert Image.open(three).height > Image.open(two).height


def test_rows_round_trip_through_json():
    loaded = json.loads(json.dumps([row.to_dict() for row in ROWS]))
    assert [bench.ResolutionRow(**data) for data in loaded] == ROWS
    assert {"size", "stack", "status", "seconds", "peak_memory_bytes", "predicted_peak_bytes", "budget_bytes",
            "psnr_vs_stock_db", "vram_cap_bytes"} <= set(loaded[0])


def test_heatmap_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "resolutions.png"
    assert bench.save_heatmap(ROWS, path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_heatmap_without_a_single_run_cell(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "none-ran.png"
    assert bench.save_heatmap(ROWS[2:3], path) is None and path.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "100"], "--sizes: 100 px must be a positive multiple of 64"),
    (["--sizes", "512", "--steps", "0"], "--steps must be >= 1, not 0"),
    (["--vram-cap", "lots"], "--vram-cap: 'lots' is not a size"),
    (["--offload-mb", "-1"], "--offload-mb must be >= 0 (0 streams the whole UNet), not -1"),
])
def test_cli_rejects_bad_options_before_booting_comfyui(capsys, tmp_path, argv, message):
    assert main(["bench", "resolutions", "--comfyui", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdopt: error: ") and message in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--stacks", "sdopt", "fast"], "argument --stacks: invalid choice: 'fast'"),
    (["--auto-goal", "quick"], "argument --auto-goal: invalid choice: 'quick'"),
])
def test_cli_rejects_unknown_stacks_and_goals(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "resolutions", "--comfyui", str(tmp_path), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_rows_refuse_unknown_stacks_and_goals_before_booting_comfyui(tmp_path):
    from sdopt.errors import UserError

    with pytest.raises(UserError, match="--stacks: give some of stock, sdopt, auto, not fast"):
        next(bench.resolution_rows(tmp_path, stacks=("stock", "fast")))
    with pytest.raises(UserError, match="--auto-goal: 'quick' is not one of fastest, balanced, fit"):
        next(bench.resolution_rows(tmp_path, auto_goal="quick"))


def test_cli_offload_mb_takes_auto_or_mib(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "resolutions", "--comfyui", str(tmp_path), "--offload-mb", "lots"])
    assert exit_.value.code == 2 and "--offload-mb: 'lots' is neither auto nor a number of MiB" in capsys.readouterr().err
