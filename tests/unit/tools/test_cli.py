"""CLI error paths: one line on stderr, exit status 2, no traceback, before ComfyUI is ever imported."""
import json
import os
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


@pytest.mark.parametrize("argv, fault", [
    (["bench", "attention", "--json", "{tmp}"], "is a folder; give a file name in it"),
    (["plan", "--model", "mini", "--json", "{tmp}"], "is a folder; give a file name in it"),
    (["run", BASELINE, "--out", "{tmp}/a-file"], "is a file, not a folder"),
    (["bench", "suite", "--out", "{tmp}/a-file"], "is a file, not a folder"),
    (["run", BASELINE, "--report-json", "{tmp}/a-file/report.json"], "cannot make the folder of"),
])
def test_an_output_path_that_cannot_be_written_stops_the_command_before_it_runs(capsys, tmp_path, argv, fault):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert exit_info.value.code == 2 and fault in capsys.readouterr().err
    assert "comfy" not in sys.modules


def test_an_output_file_gets_its_folder_before_the_command_runs(capsys, tmp_path):
    target = tmp_path / "new" / "deeper" / "rows.json"
    assert main(["bench", "attention", "--device", "cpu", "--tokens", "64", "--heads", "1", "--head-dim", "8",
                 "--backends", "sdpa", "--repeats", "1", "--json", str(target)]) == 0
    assert json.loads(target.read_text())[0]["backend"] == "sdpa"


def test_collecting_a_suite_from_a_missing_folder_names_the_option(capsys, tmp_path):
    err = _one_line_error(capsys, ["bench", "suite", "--out", str(tmp_path / "none"), "--collect"])
    assert "--out" in err and "no such folder" in err


def _cache_entry(root, key, cold_seconds):
    """An entry as sdopt writes it: meta.json carries its mark and its own key."""
    (root / key).mkdir()
    (root / key / "artifacts.bin").write_bytes(b"x" * 2048)
    (root / key / "meta.json").write_text(json.dumps({
        "written_by": "sdopt compile cache", "key": key, "settings": key.split("-", 2)[2], "created": "2026-11-23T08:00:00",
        "last_used": "2026-11-23T09:00:00", "compiles": {"2x4x64x64, 2, 2x77x768, none (float16)": {"cold_seconds": cold_seconds}},
    }))


def test_cache_list_and_purge(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDOPT_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    assert f"no sdopt compile cache entries in {tmp_path}" in capsys.readouterr().out
    _cache_entry(tmp_path, "aaaa-torch2-compile", 61.5)
    _cache_entry(tmp_path, "bbbb-torch2-trace", 3.25)
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "| aaaa-torch2-compile | compile | 0.0 | 2x4x64x64, 2, 2x77x768, none (float16): 61.5 s | 2026-11-23T08:00:00 | 2026-11-23T09:00:00 |" in listing
    assert "bbbb-torch2-trace" in listing and "left alone" not in listing
    err = _one_line_error(capsys, ["cache", "purge", "cccc"])
    assert "no entry 'cccc'" in err and "cache list" in err
    assert main(["cache", "purge", "aaaa-torch2-compile"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bbbb-torch2-trace"]
    assert main(["cache", "purge"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_cache_commands_leave_what_sdopt_did_not_write(capsys, tmp_path):
    """A cache folder pointed at a shared one (SDOPT_CACHE_DIR=~/.cache): only sdopt's entries go."""
    _cache_entry(tmp_path, "aaaa-torch2-compile", 61.5)
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "model.bin").write_bytes(b"weights")
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "aaaa-torch2-compile" in listing and "| huggingface" not in listing and "| notes.txt" not in listing
    assert f"left alone 2 item(s) in {tmp_path} that sdopt did not write: huggingface, notes.txt" in listing
    err = _one_line_error(capsys, ["cache", "purge", "huggingface", "--dir", str(tmp_path)])
    assert "not an sdopt cache entry" in err and "left alone" in err
    assert main(["cache", "purge", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huggingface", "notes.txt"]
    assert (tmp_path / "huggingface" / "model.bin").read_bytes() == b"weights"


@pytest.mark.parametrize("argv", [["cache", "list", "extra"], ["cache", "purge", "a", "b"], ["cache"]])
def test_cache_rejects_extra_or_missing_arguments(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("before", [None, "dynamic"])
def test_memory_mode_reaches_the_run_and_its_processes_then_is_restored(monkeypatch, tmp_path, before):
    """Benches start fresh processes (``--isolate``, suite phases); the mode travels in the environment,
    for the command's duration only."""
    from sdopt.tools import headless, memory_mode

    if before is None:
        monkeypatch.delenv(memory_mode.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(memory_mode.ENVIRONMENT, before)
    seen = []

    def run_workflow(*args, **kwargs):
        seen.append(memory_mode.requested_mode())
        raise headless.UserError("stop here")

    monkeypatch.setattr(headless, "run_workflow", run_workflow)
    workflow = tmp_path / "w.json"
    workflow.write_text("{}")
    assert main(["run", str(workflow), "--memory-mode", "classic"]) == 2
    assert main(["run", str(workflow)]) == 2
    assert seen == ["classic", before or "auto"]
    assert os.environ.get(memory_mode.ENVIRONMENT) == before
