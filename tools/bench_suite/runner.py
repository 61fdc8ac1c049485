"""The parent: one child process per phase (``child``), within the suite's and each phase's time limit,
and the files of each phase, the suite's index and its archive, kept as they come."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...measure.report import markdown_table
from .phases import PHASE_LIMIT_S, SUITE_LIMIT_S, Phase, over_budget

DRY_PHASE_LIMIT_S = 10 * 60
SUITE_MD, SUITE_JSON = "suite.md", "suite.json"
DONE, FAILED, TIMED_OUT, SKIPPED, PARTIAL = "done", "failed", "timed out", "skipped", "partial"
LOG_LINES = 300
# The module each phase runs in, as a fresh process (``python -m``): not imported here, so that running
# it never finds it imported already by its package.
CHILD = f"{__package__}.child"


@dataclass
class PhaseOutcome:
    number: int
    name: str
    title: str
    status: str
    seconds: float = 0.0
    skipped: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    error: str = ""


def run_suite(out: Path, phases: list[Phase], dry_run: bool = False, archive: Path | None = None,
              limit_s: float = SUITE_LIMIT_S, started=lambda phase: None, finished=lambda outcome: None) -> list[PhaseOutcome]:
    """Run ``phases`` in order, each in a child process, within ``limit_s`` (a phase that would pass it is
    skipped; the running one is stopped at it); the suite files are rewritten after every phase.
    ``started(phase)`` and ``finished(outcome)`` hear of each phase."""
    out.mkdir(parents=True, exist_ok=True)
    began, outcomes = time.monotonic(), []
    for phase in phases:
        why = phase.skip or ("" if dry_run else over_budget(phase, time.monotonic() - began, limit_s))
        if why:
            outcome = PhaseOutcome(phase.number, phase.name, phase.title, SKIPPED, skipped=[{"what": "the whole phase", "why": why}])
            write_phase(out, phase, {"rows": [], "skipped": outcome.skipped, "markdown": "", "plots": []}, 0.0)
        else:
            started(phase)
            remaining = limit_s - (time.monotonic() - began)
            outcome = _run_child(out, phase, DRY_PHASE_LIMIT_S if dry_run else min(PHASE_LIMIT_S, remaining))
        outcome.files = sorted(p.name for p in out.glob(f"{phase.stem}*"))
        outcomes.append(outcome)
        write_suite(out, outcomes)
        if archive is not None:
            write_archive(out, archive)
        finished(outcome)
    return outcomes


def _run_child(out: Path, phase: Phase, limit_s: float) -> PhaseOutcome:
    command = [sys.executable, "-m", CHILD, "--child", json.dumps(asdict(phase)), "--out", str(out)]
    log = out / f"{phase.stem}.log"
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as capture:
        try:
            # cwd: not the pack's folder, whose subfolders (nodes, tools...) would shadow ComfyUI's modules
            done = subprocess.run(command, stdout=capture, stderr=subprocess.STDOUT, text=True, timeout=limit_s, cwd=out)
            status = DONE if done.returncode == 0 else FAILED
            error = "" if status == DONE else f"exit status {done.returncode}"
        except subprocess.TimeoutExpired:
            status, error = TIMED_OUT, f"stopped after {limit_s:.0f} s, its time limit"
        capture.seek(0)
        lines = capture.read().splitlines()
    log.write_text("\n".join(lines[-LOG_LINES:]) + "\n")
    seconds = time.monotonic() - started
    result = out / f"{phase.stem}.json"
    skipped = json.loads(result.read_text()).get("skipped", []) if status == DONE and result.exists() else []
    if status != DONE:
        tail = "\n".join(lines[-20:])
        error += f"; the last lines of {log.name}:\n{tail}"
        partial = json.loads(result.read_text()) if result.exists() else {}
        finished = partial.get("rows", []) if partial.get("status") == PARTIAL else []
        markdown = f"**{status}**: {error.split(';')[0]}; see `{log.name}`."
        if finished:
            markdown += f" The {len(finished)} row(s) it finished:\n\n" + partial["markdown"]
        write_phase(out, phase, {"rows": finished, "skipped": [], "markdown": markdown, "plots": [], "status": status}, seconds)
    return PhaseOutcome(phase.number, phase.name, phase.title, status, seconds, skipped, error=error)


def write_phase(out: Path, phase: Phase, result: dict, seconds: float) -> None:
    """``NN-name.json`` and ``NN-name.md`` of a phase, written whole (a temporary file, then renamed)."""
    device = _device_text()
    data = {"phase": phase.number, "name": phase.name, "title": phase.title, "device": device, "seconds": round(seconds, 1),
            "options": phase.options, "status": result.get("status", SKIPPED if phase.skip or (not result["rows"] and result["skipped"]) else DONE),
            "rows": result["rows"], "skipped": result["skipped"], "plots": result["plots"], "markdown": result["markdown"]}
    lines = [f"## {phase.number}. {phase.title}", "", f"Device: {device}; {seconds:.0f} s.", ""]
    if result["markdown"]:
        lines += [result["markdown"], ""]
    lines += [f"![{phase.name}]({plot})" for plot in result["plots"]]
    if result["skipped"]:
        lines += ["", "Skipped:", *(f"- {s['what']}: {s['why']}" for s in result["skipped"])]
    _write_whole(out / f"{phase.stem}.json", json.dumps(data, indent=2, default=str))
    _write_whole(out / f"{phase.stem}.md", "\n".join(lines).rstrip() + "\n")


def write_suite(out: Path, outcomes: list[PhaseOutcome] = ()) -> None:
    """``suite.md`` (an index, then every phase's section present in ``out``) and ``suite.json``, from the
    phase files in ``out`` (those of earlier runs, or gathered from several, too); ``outcomes`` add this
    run's errors."""
    errors = {outcome.number: outcome.error for outcome in outcomes}
    entries, devices = [], {}
    for path in sorted(out.glob("[0-9][0-9]-*.json")):
        data = json.loads(path.read_text())
        devices[data["device"]] = None
        entries.append({"number": data["phase"], "name": data["name"], "title": data["title"], "status": data["status"],
                        "seconds": data["seconds"], "skipped": data["skipped"], "device": data["device"],
                        "files": sorted(p.name for p in out.glob(f"{path.stem}*")), "error": errors.get(data["phase"], "")})
    _write_whole(out / SUITE_JSON, json.dumps({"devices": list(devices), "phases": entries}, indent=2))
    rows = [[e["number"], e["name"], e["status"], f"{e['seconds']:.0f}", skip_summary(e["skipped"])] for e in entries]
    sections = [path.read_text() for path in sorted(out.glob("[0-9][0-9]-*.md"))]
    text = ["# sdopt GPU suite", "", f"Device: {'; '.join(devices) or _device_text()}.", "",
            *markdown_table(["phase", "name", "status", "seconds", "skipped (why)"], rows, right={0, 3}), "", *sections]
    _write_whole(out / SUITE_MD, "\n".join(text))


def skip_summary(skipped: list[dict]) -> str:
    """What a phase skipped, one entry per reason: ``what: why``, or ``N × why`` for a reason shared."""
    by_reason: dict[str, list[str]] = {}
    for entry in skipped:
        by_reason.setdefault(entry["why"], []).append(entry["what"])
    return "; ".join(f"{whats[0]}: {why}" if len(whats) == 1 else f"{len(whats)} × {why}" for why, whats in by_reason.items()) or "—"


def write_archive(out: Path, archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.is_file() and path.resolve() != archive.resolve():
                tar.add(path, arcname=path.name)
    os.replace(partial, archive)


def _write_whole(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _device_text() -> str:
    from ..headless import memory_mode_text

    memory = memory_mode_text()
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}; {memory})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__}; {memory})"
