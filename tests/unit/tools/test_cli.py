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


def test_cache_list_and_purge(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    assert f"no compiled artifacts in {tmp_path}" in capsys.readouterr().out
    for key in ("aaaa-torch2-compile", "bbbb-torch2-trace"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "artifacts.bin").write_bytes(b"x" * 2048)
        (tmp_path / key / "meta.json").write_text('{"cold_compile_seconds": 61.5, "saved": "2026-11-23T08:00:00"}')
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "aaaa-torch2-compile" in listing and "61.5" in listing and "bbbb-torch2-trace" in listing
    err = _one_line_error(capsys, ["cache", "purge", "cccc"])
    assert "no entry 'cccc'" in err and "cache list" in err
    assert main(["cache", "purge", "aaaa-torch2-compile"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bbbb-torch2-trace"]
    assert main(["cache", "purge"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and not any(tmp_path.iterdir())
