"""``python -m sdopt plan``: input errors as one line; the plans of mini at 512, SDXL's (two text encoders)
and Flux's (no T5) as printed and written; which cases ``--check`` takes, and that on the GPU it needs one."""
import json

import pytest
import torch

from sdopt.tools.cli import main
from sdopt.tools.plan import UNET_STEP, command

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def _plan(capsys, tmp_path, model: str, size: int, budget: str) -> tuple[str, dict]:
    """What ``python -m sdopt plan`` prints for ``model`` at ``size``² within ``budget`` (no search), and its JSON."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", model, "--width", str(size), "--height", str(size), "--budget", budget, "--no-search",
                 "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


@pytest.mark.parametrize("budget", ["lots", "8 parsecs", "0GiB"])
def test_bad_budget_names_the_option(budget, one_line_error):
    assert "--budget" in one_line_error(["plan", "--budget", budget])


def test_bad_size_names_the_option(one_line_error):
    assert "--width: 500 px" in one_line_error(["plan", "--width", "500"])


def test_missing_checkpoint_names_the_option(tmp_path, one_line_error):
    assert "--model" in one_line_error(["plan", "--model", str(tmp_path / "none.safetensors")])


def test_cli_prints_a_plan_for_mini_at_512(capsys, tmp_path):
    printed, plan = _plan(capsys, tmp_path, "mini", 512, "4GiB")
    assert "| UNet step | sdpa, CFG batch 2 |" in printed and "plan that fits 4,096 MiB" in printed
    assert plan["fits"] and plan["offload"] == "none"
    assert [row["stage"] for row in plan["plan"]] == ["text encode", "UNet step", "VAE decode", "VAE encode"]
    for row in plan["plan"]:
        assert row["total_bytes"] <= 4 * 2**30
        assert row["total_bytes"] == (sum(plan["weights_bytes"].values()) + row["input_bytes"] + row["peak_bytes"])
    # A UNet step with CFG at 512 holds its batch-2 activations: tens of MiB at least, and not GiBs.
    unet = plan["stock"][1]
    assert 32 * 2**20 < unet["peak_bytes"] < 2 * 2**30


def test_cli_plans_sdxl_mini(capsys, tmp_path):
    printed, plan = _plan(capsys, tmp_path, "sdxl-mini", 512, "8GiB")
    assert "sdxl-mini: the SDXL architecture" in printed
    assert plan["fits"] and [row["stage"] for row in plan["plan"]] == ["text encode", "UNet step", "VAE decode", "VAE encode"]
    # CLIP-L and OpenCLIP-G in fp32: about 0.47 and 2.6 GiB.
    assert 3.0 * 2**30 < plan["weights_bytes"]["text_encoder"] < 3.2 * 2**30
    unet = plan["stock"][1]
    assert 32 * 2**20 < unet["peak_bytes"] < 2 * 2**30


def test_cli_plans_flux_mini_without_t5(capsys, tmp_path):
    printed, plan = _plan(capsys, tmp_path, "flux-mini", 256, "8GiB")
    assert "flux-mini: the Flux architecture" in printed and "no T5-XXL" in printed
    # One double and one single block at 3072 wide, 0.535B parameters in fp32; CLIP-L for text.
    assert plan["weights_bytes"]["unet"] == 535_324_480 * 4
    assert 0.45 * 2**30 < plan["weights_bytes"]["text_encoder"] < 0.5 * 2**30
    assert plan["fits"] and 16 * 2**20 < plan["stock"][1]["peak_bytes"] < 2**30


def test_check_takes_the_cases_of_one_model(monkeypatch, one_line_error):
    asked = []
    monkeypatch.setattr(command, "check_predictions", lambda cases, repeats, dtype, workspace: asked.extend(cases) or [])
    assert main(["plan", "--check", "--model", "sdxl-mini"]) == 0
    assert [(model, stage) for model, stage, _ in asked] == [("sdxl-mini", UNET_STEP)] * 3
    assert sorted(size for *_, size in asked) == [512, 1024, 2048]
    assert "the checked models are mini, full, sdxl-mini, sd35-mini, flux-mini" in one_line_error(["plan", "--check", "--model", "sdxl-full"])
    assert "--max-size 10: it leaves out every case; the smallest checked size is 512" in one_line_error(
        ["plan", "--check", "--max-size", "10"])


def test_check_on_the_gpu_needs_one(monkeypatch, one_line_error):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--check --workspace cuda measures on a GPU, and torch sees none here" in one_line_error(
        ["plan", "--check", "--workspace", "cuda", "--dtype", "fp16"])
