"""CLI error paths: one line on stderr, exit status 2, no traceback, before ComfyUI is ever imported."""
import sys
from pathlib import Path

import pytest

from sdopt.tools.cli import main

BASELINE = str(Path(__file__).resolve().parents[3] / "workflows" / "sd15_baseline.json")


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdopt: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_comfyui_not_found(capsys, tmp_path):
    err = _one_line_error(capsys, ["run", BASELINE, "--comfyui", str(tmp_path)])
    assert f"ComfyUI not found at {tmp_path}" in err and "--comfyui" in err and "COMFYUI_PATH" in err
    assert "comfy" not in sys.modules


def test_comfyui_path_unset(capsys, monkeypatch):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    err = _one_line_error(capsys, ["run", BASELINE])
    assert "ComfyUI not found: pass --comfyui" in err


def test_invalid_json_is_reported_before_booting(capsys, tmp_path):
    bad = tmp_path / "wf.json"
    bad.write_text("{not json")
    err = _one_line_error(capsys, ["run", str(bad), "--comfyui", str(tmp_path)])
    assert "is not valid JSON" in err


def test_unknown_subcommand_is_argparse_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
