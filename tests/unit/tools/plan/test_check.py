"""``plan --check``: the predicted VAE decode peak at 512 against the peak RSS growth of a real decode in a
fresh process, the table of predictions against measurements, and on the GPU (faked) the growth of
torch's peak allocation within a cap of the prediction plus its headroom."""
import json
import math

import pytest
import torch

from sdopt.tools.cli import main
from sdopt.measure.memory_model import PLANNER_TOLERANCE
from sdopt.tools.plan import UNET_STEP, VAE_DECODE, build_modules, command, measure_stage, stage_call
from sdopt.tools.plan.check import CheckRow, check_table
from sdopt.measure.memory_model import fake_module, fake_tensor, fake_tensor_mode, predict_peak
from sdopt.tools.plan.real_stage import _allocated_growth

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

# The planner's target: predicted peak within 20% of the measured peak RSS growth (CPU, fp32).
PREDICTION_TOLERANCE = PLANNER_TOLERANCE


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from /proc")
def test_vae_decode_prediction_matches_measured_rss_at_512():
    mode = fake_tensor_mode()
    modules = {"vae": fake_module(build_modules("full", names=("vae",))["vae"], mode)}
    fn, inputs = stage_call("full", VAE_DECODE, modules, 512, 512, torch.float32, lambda shape, dtype: fake_tensor(mode, shape, dtype))
    predicted = predict_peak(fn, *inputs, mode=mode).peak_bytes
    measured = measure_stage("full", VAE_DECODE, 512, 512)
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted / 2**20, measured / 2**20)


def test_check_prints_predicted_against_measured(capsys, tmp_path, monkeypatch, one_line_error):
    monkeypatch.setattr(command, "CHECK_CASES", (("mini", UNET_STEP, 64), ("mini", UNET_STEP, 4096)))
    assert main(["plan", "--check", "--repeats", "1", "--max-size", "128", "--json", str(tmp_path / "c.json")]) == 0
    (row,) = json.loads((tmp_path / "c.json").read_text())
    assert (row["model"], row["size"]) == ("mini", 64) and len(row["measured_bytes"]) == 1, "the 4096 case is left out"
    assert row["predicted_bytes"] > 0 and row["median_bytes"] > 0
    assert "| mini unet" in capsys.readouterr().out.lower()
    assert "--repeats" in one_line_error(["plan", "--check", "--repeats", "0"])


def test_a_measurement_on_the_gpu_is_the_growth_of_torchs_peak_allocation(monkeypatch):
    """What the GPU check reads, on a fake of torch's CUDA allocator statistics: the stage's peak
    over what was allocated before it, after the peak is reset."""
    state = {"allocated": 500, "peak": 9_000}
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"])

    def stage():
        calls.append("stage")
        state["peak"] = max(state["peak"], state["allocated"] + 300)

    assert _allocated_growth(stage, torch.device("cuda")) == 300, "the peak before the stage is not the stage's"
    assert calls == ["sync", "stage", "sync"], "the stage's kernels have finished before the peak is read"


def test_the_gpu_check_caps_the_stage_at_the_prediction_plus_its_headroom(monkeypatch):
    """Under the cap, cuDNN cannot take free memory as workspace; a stage that needs more than the cap
    is out of memory, which the row and the table report as an under-prediction."""
    from types import SimpleNamespace

    fractions = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=10_000))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def set_fraction(fraction, device):
        if not isinstance(device, int) and torch.device(device).index is None:  # as torch's own check
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        fractions.append(fraction)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)

    def needs_too_much():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert _allocated_growth(needs_too_much, torch.device("cuda"), cap_bytes=1500) is None
    assert fractions == [0.25], "what torch holds now plus the cap, over the device's memory"
    row = CheckRow("full", VAE_DECODE, 1024, 100 * 2**20, [None], cap_bytes=120 * 2**20)
    assert not row.fits and math.isnan(row.error)
    assert "needs more than 120 (the prediction + 20%)" in check_table([row])
    fitting = CheckRow("full", VAE_DECODE, 1024, 100 * 2**20, [80 * 2**20], cap_bytes=120 * 2**20)
    assert fitting.fits and fitting.error == pytest.approx(0.25)
    traced = CheckRow("full", VAE_DECODE, 1024, 100 * 2**20, [80 * 2**20], 120 * 2**20,
                                  [(100 * 2**20, "aten.silu.default")])
    assert "| 100 at aten.silu.default |" in check_table([traced])
