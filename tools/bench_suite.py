"""``python -m sdopt bench suite``: everything a lent GPU must show, in phases, each in its own process.

The plan (``plan_phases``) is fixed and numbered, so ``--phase N`` names the same phase everywhere:

1. gpu-tests: ``pytest tests/gpu``;
2. doctor: ``python -m sdopt doctor``;
3. speed: ``bench speed``, the SD1.5 ladder at 512², 20 steps, the channels-last rung included;
4. competitors: ``bench speed`` with stock ComfyUI, sdopt's fastest rung, ComfyUI's TorchCompileModel and
   diffusers' own UNet and pipeline;
5. speed-sdxl: the SDXL ladder at 1024², planned once ``bench speed`` knows ``--sdxl-model``;
6. attention: ``bench attention``, every registered backend, fp16;
7. vae: VAE decode on the device: untiled, tiled within a budget, and tiled with an out-of-memory error
   injected into the first try, which the tiler must retry with smaller tiles;
8-10. res-8gib, res-4gib, res-2gib: ``bench resolutions`` under each ``--vram-cap``;
11. offload: sdopt Offload's modes: MiB resident, steady it/s, peak memory, output against full residency;
12. cache: the step caches, sdopt's and ComfyUI's EasyCache, plain and compiled;
13. flux-12gib: Flux under a 12 GiB cap through sdopt Offload, against the uncapped model;
14. diffusers-compile: diffusers' pipeline with its torch.compile max-autotune recipe, beside stock. Apart
    from phase 4 because max-autotune's compile time is unknown on the device: a phase stopped at its
    limit keeps nothing, and phase 4's rows must not wait on it.

Each phase has a budget of planned seconds on an H100 (at most ``PHASE_LIMIT_S``, together at most
``SUITE_LIMIT_S``); a phase that would take the suite past its limit is skipped, with the reason, and
a running phase is stopped at ``PHASE_LIMIT_S``. Each phase runs in a child process and writes
``NN-name.json`` (its rows, what it skipped and why), ``NN-name.md`` (its section) and its plots into the
output folder as it finishes; ``suite.md`` and ``suite.json`` are rebuilt from the phases present after
each one, so a phase that breaks, or a machine taken back, never loses the ones before. ``archive``
keeps a .tar.gz of the folder up to date after each phase.

``dry_run`` runs the same plan at tiny sizes on a CPU (CI does), leaving out what takes minutes there
(each compiling rung, the SDXL checkpoint) and saying so.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..errors import UserError
from ..measure.report import markdown_table
from .bench_speed import COMPILING_RUNGS

PHASE_LIMIT_S = 9 * 60
SUITE_LIMIT_S = 40 * 60
DRY_PHASE_LIMIT_S = 10 * 60
REPO = Path(__file__).resolve().parents[1]
SUITE_MD, SUITE_JSON = "suite.md", "suite.json"
GIB = 2**30
MIB = 2**20
DONE, FAILED, TIMED_OUT, SKIPPED, PARTIAL = "done", "failed", "timed out", "skipped", "partial"
LOG_LINES = 300

SPEED_LADDER = ["stock", "precision", "attention", "trace", "compile", "graph", "compile+graph", "compile+graph+channels_last", "TorchCompileModel"]
COMPETITORS = ["stock", "compile+graph+channels_last", "TorchCompileModel", "diffusers"]
DIFFUSERS_COMPILED = ["stock", "diffusers+compile"]
SDXL_LADDER = ["stock", "attention", "compile+graph+channels_last", "TorchCompileModel"]
CACHES = ["stock", "compile+graph", "cache", "compile+graph+cache", "EasyCache", "compile+graph+EasyCache"]
CPU_COMPILE_SKIP = "left out of the dry run: each compile of the UNet takes a minute or more on a CPU"
DRY_PRECISION_SKIP = "left out of the dry run: the attention rung runs the same Precision node beneath it"


@dataclass(frozen=True)
class Phase:
    """One numbered phase: ``runner`` names the function of this module that runs it in the child process
    with ``options``; ``budget_s`` is its planned time on an H100; ``skip`` says why it will not run."""

    number: int
    name: str
    title: str
    runner: str
    budget_s: int
    options: dict = field(default_factory=dict)
    skip: str = ""

    @property
    def stem(self) -> str:
        return f"{self.number:02d}-{self.name}"


def _sdxl_known(model: str) -> bool:
    """Whether the generated models (and so ``bench speed``) include ``model``."""
    from .modelgen import SIZES

    return model in SIZES


def plan_phases(model: str | None = None, sdxl_model: str = "sdxl-full", dry_run: bool = False, comfyui: str | None = None,
                models: str | None = None) -> list[Phase]:
    """The suite's phases in order, with their options (tiny on a CPU for ``dry_run``) and budgets.
    ``model``: the SD1.5 model of phases 3, 4 and 8-11 (default full; mini in a dry run)."""
    common = {"comfyui": comfyui, "models": models}
    model = model or ("mini" if dry_run else "full")
    speed = {"size": 64, "steps": 2, "rounds": 1} if dry_run else {"size": 512, "steps": 20, "rounds": 3}

    def skip_rungs(rungs):
        if not dry_run:
            return {}
        skipped = {rung: CPU_COMPILE_SKIP for rung in rungs if rung in COMPILING_RUNGS}
        return {**skipped, "precision": DRY_PRECISION_SKIP} if "precision" in rungs else skipped
    phases = [
        Phase(1, "gpu-tests", "tests/gpu", "run_gpu_tests", 360),
        Phase(2, "doctor", "sdopt doctor", "run_doctor", 30, {"comfyui": comfyui}),
        Phase(3, "speed", f"bench speed: the SD1.5 ladder ({model})", "run_speed", 210,
              {**common, "model": model, **speed, "rungs": SPEED_LADDER, "skip_rungs": skip_rungs(SPEED_LADDER)}),
        Phase(4, "competitors", f"bench speed: sdopt against TorchCompileModel and diffusers ({model})", "run_speed", 210,
              {**common, "model": model, **speed, "rungs": COMPETITORS, "skip_rungs": skip_rungs(COMPETITORS)}),
        Phase(5, "speed-sdxl", f"bench speed: the SDXL ladder ({sdxl_model})", "run_speed", 300,
              {**common, "model": sdxl_model, "size": 1024, "steps": 20, "rounds": 2, "rungs": SDXL_LADDER, "skip_rungs": {}}),
        Phase(6, "attention", "bench attention: every backend", "run_attention", 30,
              {"tokens": [64, 256], "dtype": "fp32", "device": "cpu"} if dry_run else
              {"tokens": [1024, 4096, 16384], "dtype": "fp16", "device": "cuda"}),
        Phase(7, "vae", "VAE decode on the device, with an injected out-of-memory retry", "run_vae", 90,
              {"model": "tiny", "sizes": [128], "budget_mb": 64} if dry_run else {"model": "full", "sizes": [1024, 2048, 4096], "budget_mb": 1024}),
    ]
    for number, cap, sizes, offload_mb, budget in ((8, 8, [1024, 2048, 4096], 1024, 180), (9, 4, [1024, 2048, 3072], 1024, 90),
                                                   (10, 2, [512, 1024, 2048], 0, 120)):
        options = {**common, "model": model, "sizes": [64] if dry_run else sizes, "steps": 2 if dry_run else 4,
                   "vram_cap_gib": cap, "offload_mb": offload_mb}
        phases.append(Phase(number, f"res-{cap}gib", f"bench resolutions with VRAM capped at {cap} GiB", "run_resolutions", budget, options))
    phases.append(Phase(11, "offload", "sdopt Offload: residency, speed and output per mode", "run_offload", 60,
                        {**common, "model": model, "size": 64 if dry_run else 512, "steps": 2 if dry_run else 20, "warm_up": not dry_run,
                         # on a CPU every mode is the same no-op: two show the table's making
                         "modes": [OFFLOAD_MODES[0], OFFLOAD_MODES[3]] if dry_run else list(OFFLOAD_MODES)}))
    phases.append(Phase(12, "cache", f"bench speed: step caches, sdopt's and ComfyUI's EasyCache, plain and compiled ({model})", "run_speed", 240,
                        {**common, "model": model, **speed, "rungs": CACHES, "skip_rungs": skip_rungs(CACHES)}))
    phases.append(Phase(13, "flux-12gib", f"Flux ({FLUX_MODEL}) under a 12 GiB cap through sdopt Offload, against the uncapped model", "run_offload", 300,
                        {**common, "model": FLUX_MODEL, "size": 1024, "steps": 8, "warm_up": True, "modes": list(FLUX_CAPPED_MODES)},
                        skip=("left out of the dry run: phase 11 runs the same runner on the CPU, where a cap does not apply"
                              if dry_run else "")))
    phases.append(Phase(14, "diffusers-compile", f"bench speed: diffusers with torch.compile max-autotune ({model})", "run_speed", 180,
                        {**common, "model": model, **speed, "rungs": DIFFUSERS_COMPILED, "skip_rungs": skip_rungs(DIFFUSERS_COMPILED)},
                        skip=("left out of the dry run: its one rung beside stock compiles, which takes minutes on a CPU"
                              if dry_run else "")))
    if dry_run:
        phases[4] = replace(phases[4], skip="left out of the dry run: generating and loading an SDXL checkpoint takes minutes on a CPU")
        phases[8] = replace(phases[8], skip="left out of the dry run: phase 8's runner and stacks at another cap (phase 10 runs "
                                            "the sequential-offload stack)")
    elif not _sdxl_known(sdxl_model):
        phases[4] = replace(phases[4], skip=f"bench speed has no {sdxl_model} model yet (the generated models are listed by `python -m sdopt make-model -h`)")
    return phases


def check_budget(phases: list[Phase]) -> None:
    """Every phase within ``PHASE_LIMIT_S`` and the planned ones within ``SUITE_LIMIT_S`` together."""
    for phase in phases:
        if phase.budget_s > PHASE_LIMIT_S:
            raise ValueError(f"phase {phase.number} ({phase.name}) plans {phase.budget_s} s, above the {PHASE_LIMIT_S} s a phase may take")
    total = sum(phase.budget_s for phase in phases if not phase.skip)
    if total > SUITE_LIMIT_S:
        raise ValueError(f"the planned phases take {total} s together, above the suite's {SUITE_LIMIT_S} s")


def select(phases: list[Phase], numbers: list[int] | None) -> list[Phase]:
    """The phases named by ``numbers``, in the order given (a short device lease runs what matters
    first), each once; every phase when none is named."""
    if not numbers:
        return phases
    known = {phase.number for phase in phases}
    unknown = [n for n in numbers if n not in known]
    if unknown:
        raise UserError(f"--phase {unknown[0]}: choose from {', '.join(f'{p.number} ({p.name})' for p in phases)}")
    by_number = {phase.number: phase for phase in phases}
    return [by_number[n] for n in dict.fromkeys(numbers)]


def over_budget(phase: Phase, elapsed_s: float, limit_s: float = SUITE_LIMIT_S) -> str:
    """Why ``phase`` must not start after ``elapsed_s`` of the suite, or ''."""
    if elapsed_s + phase.budget_s > limit_s:
        return (f"it plans {phase.budget_s / 60:.1f} min and the suite has run {elapsed_s / 60:.1f} of its "
                f"{limit_s / 60:.0f} min; run it on its own with --phase {phase.number}")
    return ""


# --- the parent: one child process per phase, results kept as they come --------------------------


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
    command = [sys.executable, "-m", __name__, "--child", json.dumps(asdict(phase)), "--out", str(out)]
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
    from .headless import memory_mode_text

    memory = memory_mode_text()
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}; {memory})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__}; {memory})"


# --- the phases, run in the child ----------------------------------------------------------------


def _skips(skipped: dict[str, str]) -> list[dict]:
    return [{"what": what, "why": why} for what, why in skipped.items()]


def run_gpu_tests(out: Path, phase: Phase) -> dict:
    report = out / f"{phase.stem}.junit.xml"
    # What each test prints (its figures) goes into the junit report and so into the section. Log
    # records below WARNING stay out: torch's DEBUG trace records once filled the log and pushed the
    # failing test's figures out of the part of it that is kept.
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "--log-level=WARNING",
               "-o", "junit_logging=system-out", f"--junitxml={report}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-100000:], done.stderr[-4000:], sep="\n")
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report (exit status {done.returncode})")
    rows = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                text = (found.get("message") or found.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
        printed = re.sub(r"^-+ Captured Out -+\n", "", (case.findtext("system-out") or "").strip()).strip()
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "seconds": float(case.get("time") or 0),
                     "message": message, "printed": printed})
    report.unlink()
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    table = markdown_table(["test", "outcome", "s", "message"], [[r["test"], r["outcome"], f"{r['seconds']:.1f}", r["message"] or "—"] for r in rows], right={2})
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    skipped = {r["test"]: r["message"] for r in rows if r["outcome"] == "skipped"}
    printed = [f"`{r['test']}` printed:\n\n```\n{r['printed']}\n```" for r in rows if r["printed"]]
    markdown = "\n\n".join([f"`pytest tests/gpu`: {summary}.", "\n".join(table), *printed])
    return {"rows": rows, "markdown": markdown, "plots": [], "skipped": _skips(skipped)}


def run_doctor(out: Path, phase: Phase) -> dict:
    from .doctor import default_device, doctor_table, load_comfyui, run_checks, summary

    comfyui = load_comfyui(phase.options.get("comfyui") or os.environ.get("COMFYUI_PATH"))
    rows = run_checks(default_device(comfyui), comfyui)
    return {"rows": [row.to_dict() for row in rows], "markdown": f"{summary(rows)}.\n\n{doctor_table(rows)}", "plots": [], "skipped": []}


def run_speed(out: Path, phase: Phase) -> dict:
    from .bench_speed import OFFERED_RUNGS, bench_speed, save_plot, speed_table
    from .diffusers_pipeline import unavailable_reason

    options = phase.options
    skipped = dict(options["skip_rungs"])
    for rung in ("diffusers", "diffusers+compile"):
        reason = unavailable_reason(options["model"]) if rung in options["rungs"] else None
        if reason:
            skipped[rung] = reason
    skipped.update({rung: "bench speed does not offer it" for rung in options["rungs"] if rung not in OFFERED_RUNGS})
    rungs = [rung for rung in options["rungs"] if rung not in skipped]
    rows = bench_speed(options["comfyui"] or os.environ.get("COMFYUI_PATH"), model=options["model"], size=options["size"], steps=options["steps"],
                       rounds=options["rounds"], rungs=rungs, models=Path(options["models"]) if options["models"] else None, progress=False)
    plot = f"{phase.stem}.png"
    plots = [] if save_plot(rows, out / plot) else [plot]
    heading = f"`bench speed --model {options['model']} --size {options['size']} --steps {options['steps']} --rounds {options['rounds']}`"
    return {"rows": [row.to_dict() for row in rows], "markdown": f"{heading}\n\n{speed_table(rows)}", "plots": plots,
            "skipped": _skips({f"rung {rung}": why for rung, why in skipped.items()})}


def run_attention(out: Path, phase: Phase) -> dict:
    from .bench_attention import STATUS_OK, attention_table, bench_attention

    options = phase.options
    device = options["device"] if options["device"] != "cuda" or torch.cuda.is_available() else "cpu"
    rows = bench_attention(options["tokens"], heads=8, head_dim=64, dtype=options["dtype"] if device == "cuda" else "fp32", device=device, progress=False)
    skipped = {f"{r.backend} at {r.tokens} tokens": r.reason for r in rows if r.status != STATUS_OK}
    plot = f"{phase.stem}.png"
    plots = [plot] if _bar_plot(out / plot, {f"{r.backend}": {r.tokens: r.mean_s * 1e3} for r in rows if r.status == STATUS_OK},
                                "ms per call (log scale)", f"attention backends on {device}", log=True) else []
    return {"rows": [r.to_dict() for r in rows], "markdown": attention_table(rows), "plots": plots, "skipped": _skips(skipped)}


class InjectedOOM:
    """Raises an out-of-memory error from ``module``'s forward ``times`` times, as a full device would."""

    def __init__(self, module: torch.nn.Module, times: int = 1):
        self.left = times
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        if self.left > 0:
            self.left -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected by sdopt bench suite)")

    def remove(self):
        self.handle.remove()


def run_vae(out: Path, phase: Phase) -> dict:
    from ..measure.profiler import PeakMemory
    from ..optim.tiled_vae import TiledVAEConfig, tiled_decode
    from .bench_vae import build_vae, psnr

    options = phase.options
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    vae = build_vae(options["model"]).to(device, dtype)
    downscale = 2 ** (len(vae.config.block_out_channels) - 1)
    config = TiledVAEConfig(budget_bytes=options["budget_mb"] * MIB)
    rows, skipped, memory = [], {}, PeakMemory(device)

    def measured(decode):
        memory.reset()
        started = time.perf_counter()
        image, stats = decode()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return image, stats, time.perf_counter() - started, memory.read().peak_bytes

    for size in options["sizes"]:
        latent = torch.randn(1, vae.config.latent_channels, size // downscale, size // downscale, generator=torch.Generator().manual_seed(size)).to(device, dtype)
        with torch.inference_mode():
            try:
                reference, _, seconds, peak = measured(lambda: (vae.decode(latent).sample, None))
                rows.append({"size": size, "mode": "untiled", "seconds": seconds, "peak_memory_bytes": peak})
            except torch.OutOfMemoryError:
                reference = None
                skipped[f"untiled {size}²"] = "out of memory on this device"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            stats = None
            for mode, injected in (("tiled", 0), ("tiled + injected OOM", 1)):
                if injected and stats is not None and stats.last_resort:
                    skipped[f"{mode} {size}²"] = (f"the plain tiled decode already ran at its last resort ({stats.describe()}): "
                                                  "an out-of-memory error there is raised, with nothing smaller to retry")
                    continue
                hook = InjectedOOM(vae.decoder.conv_out, injected) if injected else None
                try:
                    result, stats, seconds, peak = measured(lambda: _tiled(tiled_decode, vae, latent, config))
                finally:
                    if hook is not None:
                        hook.remove()
                rows.append({"size": size, "mode": mode, "seconds": seconds, "peak_memory_bytes": peak, "tile": stats.tile,
                             "tiles": stats.tiles, "oom_retries": stats.oom_retries, "tiles_tried": list(stats.tiles_tried),
                             "psnr_vs_untiled_db": None if reference is None else psnr(result.float().cpu(), reference.float().cpu())})
                if injected and stats.oom_retries < injected:
                    raise RuntimeError(f"the injected out-of-memory error at {size}² was not retried: {stats.describe()}")
    kind = "VRAM" if device.type == "cuda" else "RAM"
    table = markdown_table(
        ["size", "mode", "tile", "tiles", "OOM retries (tiles tried)", "seconds", f"peak {kind} MiB", "PSNR vs untiled dB"],
        [[f"{r['size']}²", r["mode"], r.get("tile") or "—", r.get("tiles") or "—",
          f"{r['oom_retries']} ({' → '.join(map(str, r['tiles_tried']))})" if "oom_retries" in r else "—", f"{r['seconds']:.2f}",
          f"{r['peak_memory_bytes'] / MIB:,.0f}", "—" if r.get("psnr_vs_untiled_db") is None else (
              "identical" if math.isinf(r["psnr_vs_untiled_db"]) else f"{r['psnr_vs_untiled_db']:.1f}")] for r in rows],
        right={2, 3, 5, 6, 7})
    heading = (f"{options['model']} VAE (diffusers AutoencoderKL, random weights) in {str(dtype).removeprefix('torch.')} on {device}; "
               f"tiled within a {options['budget_mb']} MiB budget; the injected error is raised by the decoder's last convolution "
               "on the first try")
    plot = f"{phase.stem}.png"
    series = {}
    for r in rows:
        series.setdefault(r["mode"], {})[f"{r['size']}²"] = r["peak_memory_bytes"] / MIB
    plots = [plot] if _bar_plot(out / plot, series, f"peak {kind} MiB", "VAE decode: peak memory per mode") else []
    return {"rows": rows, "markdown": heading + "\n\n" + "\n".join(table), "plots": plots, "skipped": _skips(skipped)}


def _tiled(verb, vae, latent, config):
    result = verb(vae, latent, config)
    return result.output, result.stats


def run_resolutions(out: Path, phase: Phase) -> dict:
    """Each finished cell is written at once as the phase's partial result, so a phase stopped at its
    time limit keeps the cells it finished."""
    from .bench_resolutions import resolution_rows, resolutions_table, save_heatmap

    options = phase.options
    heading = (f"`bench resolutions --model {options['model']} --sizes {','.join(map(str, options['sizes']))} --steps {options['steps']} "
               f"--vram-cap {options['vram_cap_gib']}GiB --offload-mb {options['offload_mb']}`")

    def result(rows, plots=()):
        skipped = {f"{r.stack} at {r.size}²": r.status for r in rows if getattr(r, "status", "ok") != "ok"}
        return {"rows": [r.to_dict() for r in rows], "markdown": f"{heading}\n\n{resolutions_table(rows)}", "plots": list(plots),
                "skipped": _skips(skipped)}

    started, rows = time.monotonic(), []
    for row in resolution_rows(options["comfyui"] or os.environ.get("COMFYUI_PATH"), model=options["model"], sizes=options["sizes"],
                               steps=options["steps"], vram_cap=options["vram_cap_gib"] * GIB,
                               models=Path(options["models"]) if options["models"] else None, offload_mb=options["offload_mb"]):
        rows.append(row)
        write_phase(out, phase, {**result(rows), "status": PARTIAL}, time.monotonic() - started)
    plot = f"{phase.stem}.png"
    return result(rows, [] if save_heatmap(rows, out / plot) else [plot])


# (mode, budget MiB, VRAM cap GiB or None); the first is every row's reference
OFFLOAD_MODES = (("none", 0, None), ("budget", 1024, None), ("budget", 256, None), ("sequential", 0, None), ("unload_after", 0, None))
FLUX_MODEL = "flux-full"
# Issue 17's 12 GiB card: Flux-dev's 22.2 GiB of bf16 weights, 8 GiB of them resident, beside the
# activations and the VAE decode.
FLUX_CAPPED_MODES = (("none", 0, None), ("budget", 8192, 12))


def run_offload(out: Path, phase: Phase) -> dict:
    from .bench_speed import encode_prompts, empty_latent, optimization_notes, pixel_difference, profiled_sample, timed_decode
    from .bench_unet import checkpoint_path, load_checkpoint
    from .headless import boot

    options = phase.options
    host = boot(options["comfyui"] or os.environ.get("COMFYUI_PATH"))  # puts ComfyUI's modules on the path
    import comfy.model_management
    import comfy.patcher_extension

    models = Path(options["models"]) if options["models"] else Path(host.path) / "models"
    base, clip, vae = load_checkpoint(checkpoint_path(options["model"], models))
    conds = encode_prompts(clip, options["size"])
    latent = empty_latent(base, options["size"])
    offload = host.node_classes["SDOptOffload"]()
    rows, images = [], {}
    for mode, budget, cap_gib in options["modes"]:
        seen = {}

        def residency(executor, *args, **kwargs):
            patcher = args[0].model_patcher
            seen.update(resident=patcher.loaded_size(), total=patcher.model_size())
            return executor(*args, **kwargs)

        model = offload.patch(base, mode, budget, "fallback")[0]
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE, "sdopt.bench.residency", residency)
        label = mode + (f" {budget} MiB" if mode == "budget" else "") + (f", {cap_gib} GiB cap" if cap_gib else "")
        comfy.model_management.unload_all_models()
        host.set_vram_cap(cap_gib * GIB if cap_gib else None)
        try:
            with torch.inference_mode():
                if options["warm_up"]:  # a first prompt pays for loading and for cuDNN's and the allocator's first calls
                    profiled_sample(host, model, label, latent, conds, options["steps"])
                    comfy.model_management.unload_all_models()
                samples, run, wall = profiled_sample(host, model, label, latent, conds, options["steps"])
                images[label] = timed_decode(vae, samples)[0]
        finally:
            comfy.model_management.unload_all_models()
            host.set_vram_cap(None)
        first = rows[0] if rows else {"mode": label, "steady_it_per_s": run["steady_it_per_s"]}  # the reference row
        largest, mean = pixel_difference(images[label], images[first["mode"]])
        rows.append({"mode": label, "vram_cap_gib": cap_gib, "resident_bytes": seen.get("resident"), "model_bytes": seen.get("total"),
                     "steady_it_per_s": run["steady_it_per_s"], "sampler_s": run["sampler_total_s"], "peak_memory_bytes": run["peak_memory_bytes"],
                     "memory_kind": run["memory_kind"], "step_time_vs_reference": first["steady_it_per_s"] / run["steady_it_per_s"],
                     "max_pixel_diff_vs_reference": largest, "mean_pixel_diff_vs_reference": mean,
                     "notes": optimization_notes(run["optimizations"])})
    kind = "VRAM" if rows[0]["memory_kind"] == "vram_allocated" else "RAM"
    table = markdown_table(
        ["mode", "resident MiB (of the model's)", "steady it/s", "step time vs first row", "sampler s", f"peak {kind} MiB",
         "vs first row: max / mean levels"],
        [[r["mode"], f"{(r['resident_bytes'] or 0) / MIB:,.0f} of {(r['model_bytes'] or 0) / MIB:,.0f}", f"{r['steady_it_per_s']:.2f}",
          f"{r['step_time_vs_reference']:.2f}x", f"{r['sampler_s']:.2f}", f"{r['peak_memory_bytes'] / MIB:,.0f}",
          f"{r['max_pixel_diff_vs_reference']:.1f} / {r['mean_pixel_diff_vs_reference']:.2f}"]
         for r in rows], right={1, 2, 3, 4, 5, 6})
    notes = [f"- **{r['mode']}**: {r['notes']}" for r in rows]
    heading = (f"{options['model']}, {options['size']}², {options['steps']} euler steps, ComfyUI's KSampler through sdopt Offload; "
               "resident: the diffusion model's weights on the device when sampling starts; a cap applies to its row only")
    plot = f"{phase.stem}.png"
    plots = [plot] if _bar_plot(out / plot, {"steady it/s": {r["mode"]: r["steady_it_per_s"] for r in rows}}, "steady it/s",
                                "sdopt Offload: speed per mode") else []
    skipped = {} if base.load_device.type == "cuda" else {"offloading": "the model runs on the CPU: every mode is a recorded no-op"}
    return {"rows": rows, "markdown": "\n".join([heading, "", *table, "", *notes]), "plots": plots, "skipped": _skips(skipped)}


def _bar_plot(path: Path, series: dict[str, dict], ylabel: str, title: str, log: bool = False) -> bool:
    """Grouped bars: one group per key of the inner dicts, one bar per series. False without matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys(key for values in series.values() for key in values))
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(series)) / 2), 4))
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        positions = [groups.index(key) + index * width for key in values]
        ax.bar(positions, list(values.values()), width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [str(g) for g in groups])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _child(phase_json: str, out: Path) -> None:
    phase = Phase(**json.loads(phase_json))
    started = time.monotonic()
    result = globals()[phase.runner](out, phase)
    write_phase(out, phase, result, time.monotonic() - started)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    _child(arguments[arguments.index("--child") + 1], Path(arguments[arguments.index("--out") + 1]))
