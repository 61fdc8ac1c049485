"""bench speed's image check: the difference of two images in levels of 0–255, and the tolerance
a traced, compiled or graphed rung's image must keep to its eager twin's; the inductor warm-up
before the first compiling rung; ``--isolate``'s one fresh process per rung."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sdopt.errors import UserError

from sdopt.measure.profiler import MEMORY_RAM
from sdopt.nodes import checks
from sdopt.tools import bench_speed
from sdopt.tools.bench_speed import (
    COMPILER_CACHE_VARIABLES,
    IMAGE_TOLERANCE,
    ImageTolerance,
    SpeedRow,
    bench_speed_isolated,
    pixel_difference,
    speed_table,
    warm_inductor,
)


def test_difference_is_in_levels_of_255():
    reference = torch.full((1, 8, 8, 3), 0.5)
    image = reference.clone()
    image[0, 0, 0, 0] += 4 / 255
    image[0, 1, 1, 1] -= 2 / 255
    largest, mean = pixel_difference(image, reference)
    assert largest == pytest.approx(4, abs=1e-4)
    assert mean == pytest.approx(6 / image.numel(), abs=1e-6)


def test_tolerance_bounds_the_largest_and_the_mean_difference():
    tolerance = ImageTolerance(max_levels=16, mean_levels=2)
    assert tolerance.admits(16, 2)
    assert not tolerance.admits(16.5, 0.1), "one pixel far off is out"
    assert not tolerance.admits(3, 2.5), "a small shift everywhere is out too"


def test_a_stale_weight_image_is_out_of_the_shipped_tolerance():
    generator = torch.Generator().manual_seed(0)
    eager = torch.rand(1, 64, 64, 3, generator=generator)
    stale = torch.rand(1, 64, 64, 3, generator=generator)
    assert not IMAGE_TOLERANCE.admits(*pixel_difference(stale, eager))
    assert IMAGE_TOLERANCE.admits(*pixel_difference((eager + 1 / 255).clamp(0, 1), eager))


def test_inductor_is_warmed_by_a_real_tiny_compile_or_says_it_could_not(monkeypatch):
    compiled = []
    real = checks.compile_trial
    monkeypatch.setattr(checks, "compile_trial", lambda device: compiled.append(device) or real(device))
    seconds = warm_inductor(torch.device("cpu"))
    assert compiled == [torch.device("cpu")] and seconds > 0

    def no_compiler(device):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(checks, "compile_trial", no_compiler)
    assert warm_inductor(torch.device("cpu")) is None


def _row(rung: str, start_up_s=None) -> SpeedRow:
    return SpeedRow(rung=rung, nodes="—", steady_it_per_s=1.0, speedup_median=1.0, speedup_min=1.0, speedup_max=1.0,
                    first_run_s=1.0, compile_s=0.0, sampler_s=1.0, decode_s=0.1, end_to_end_s=1.1, peak_memory_bytes=2**20,
                    memory_kind=MEMORY_RAM, max_pixel_diff=0.0, device="cpu", inductor_start_up_s=start_up_s)


def test_the_table_says_the_start_up_was_paid_before_the_rungs():
    assert "tiny compile took 2.4 s" in speed_table([_row("stock", 2.4), _row("compile")])
    assert "tiny compile" not in speed_table([_row("stock"), _row("graph")]), "no compiling rung, no warm-up"


def test_the_table_names_the_memory_mode_and_what_dynamic_vram_mapped():
    classic = speed_table([_row("stock")])
    assert "memory management" not in classic, "a ComfyUI without dynamic VRAM has no mode to name"
    dynamic = replace(_row("stock"), memory_mode="dynamic VRAM", peak_outside_allocator_bytes=3 * 2**20)
    table = speed_table([dynamic])
    assert "| 1.0 RAM + 3.0 dynamic VRAM |" in table
    assert table.endswith("ComfyUI's memory management: dynamic VRAM (--memory-mode).")


def _comfyui_tree(root: Path) -> Path:
    """The files by which sdopt recognises a ComfyUI folder."""
    (root / "ComfyUI" / "comfy").mkdir(parents=True)
    (root / "ComfyUI" / "comfy" / "model_patcher.py").touch()
    (root / "ComfyUI" / "execution.py").touch()
    return root / "ComfyUI"


def test_isolate_refuses_bad_options_before_starting_any_process(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_speed, "run_in_fresh_process", lambda *args, **kwargs: pytest.fail("a child was started"))
    with pytest.raises(UserError, match="--rungs: unknown warp"):
        bench_speed_isolated(_comfyui_tree(tmp_path), rungs=["warp"], progress=False)
    with pytest.raises(UserError, match="ComfyUI not found"):
        bench_speed_isolated(tmp_path / "nowhere", rungs=["compile"], progress=False)
    with pytest.raises(UserError, match="--model 'nothing.safetensors' is neither"):
        bench_speed_isolated(tmp_path / "ComfyUI", model="nothing.safetensors", rungs=["compile"], progress=False)


def test_isolate_runs_each_rung_in_its_own_process_with_empty_compiler_caches(monkeypatch, tmp_path):
    children = []

    def fresh_process(module, spec, what, env, show_progress):
        caches = [Path(env[variable]) for variable in COMPILER_CACHE_VARIABLES]
        children.append((spec, caches))
        assert module == bench_speed.__spec__.name and what == f"the {spec['rungs'][1]} rung"
        assert all(not path.exists() and path.parent.is_dir() for path in caches), "an empty folder of the child's own"
        return [_row(rung).to_dict() for rung in spec["rungs"]]

    monkeypatch.setattr(bench_speed, "run_in_fresh_process", fresh_process)
    comfyui, checkpoint = _comfyui_tree(tmp_path), tmp_path / "models" / "checkpoints" / "model.safetensors"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.touch()
    rows = bench_speed_isolated(comfyui, rungs=["stock", "compile", "compile_regional"], model=str(checkpoint),
                                models=tmp_path / "models", steps=8, progress=False)

    assert [row.rung for row in rows] == ["stock", "compile", "compile_regional"]
    assert all(row.isolated for row in rows)
    assert [spec["rungs"] for spec, _ in children] == [["stock", "compile"], ["stock", "compile_regional"]]
    first, second = children
    assert first[0]["models"] == str(tmp_path / "models") and first[0]["steps"] == 8, "options reach the child as JSON"
    assert first[0]["comfyui"] == str(comfyui.resolve()) and first[0]["model"] == str(checkpoint)
    assert not set(first[1]) & set(second[1]), "no rung sees another's caches"
    assert not any(path.parent.exists() for _, caches in children for path in caches), "removed after the child"
    assert "fresh process beside a stock run of its own" in speed_table(rows)
    assert "fresh process" not in speed_table([_row("stock"), _row("compile")])
