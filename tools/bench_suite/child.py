"""The phases, each run in a child process of its own (``runner`` starts it): ``python -m`` this module
``--child PHASE_JSON --out FOLDER`` runs the function of this module that the phase names and writes
its files."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from ...measure.report import markdown_table
from .phases import Phase
from .runner import PARTIAL, write_phase

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
MIB = 2**20


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
    from ...nodes.checks import default_device, doctor_table, run_checks, summary
    from ..doctor import load_comfyui

    comfyui = load_comfyui(phase.options.get("comfyui") or os.environ.get("COMFYUI_PATH"))
    rows = run_checks(default_device(comfyui), comfyui)
    return {"rows": [row.to_dict() for row in rows], "markdown": f"{summary(rows)}.\n\n{doctor_table(rows)}", "plots": [], "skipped": []}


def run_speed(out: Path, phase: Phase) -> dict:
    from ..bench_speed import OFFERED_RUNGS, bench_speed, save_plot, speed_table
    from ..diffusers_pipeline import unavailable_reason

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
    from ..bench_attention import STATUS_OK, attention_table, bench_attention

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
    from ...measure.profiler import PeakMemory
    from ...optim.tiled_vae import TiledVAEConfig, tiled_decode
    from ..bench_vae import build_vae, psnr

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
    from ..bench_resolutions import resolution_rows, resolutions_table, save_heatmap

    options = phase.options
    heading = (f"`bench resolutions --model {options['model']} --sizes {','.join(map(str, options['sizes']))} --steps {options['steps']} "
               f"--vram-cap {options['vram_cap_gib']}GiB --offload-mb {options['offload_mb']} --stacks {' '.join(options['stacks'])}"
               + (f" --auto-goal {options['auto_goal']}`" if "auto" in options["stacks"] else "`"))

    def result(rows, plots=()):
        skipped = {f"{r.stack} at {r.size}²": r.status for r in rows if getattr(r, "status", "ok") != "ok"}
        return {"rows": [r.to_dict() for r in rows], "markdown": f"{heading}\n\n{resolutions_table(rows)}", "plots": list(plots),
                "skipped": _skips(skipped)}

    started, rows = time.monotonic(), []
    for row in resolution_rows(options["comfyui"] or os.environ.get("COMFYUI_PATH"), model=options["model"], sizes=options["sizes"],
                               steps=options["steps"], vram_cap=options["vram_cap_gib"] * GIB,
                               models=Path(options["models"]) if options["models"] else None, offload_mb=options["offload_mb"],
                               stacks=tuple(options["stacks"]), auto_goal=options["auto_goal"]):
        rows.append(row)
        write_phase(out, phase, {**result(rows), "status": PARTIAL}, time.monotonic() - started)
    plot = f"{phase.stem}.png"
    return result(rows, [] if save_heatmap(rows, out / plot) else [plot])


def run_offload(out: Path, phase: Phase) -> dict:
    from ..bench_speed import encode_prompts, empty_latent, optimization_notes, pixel_difference, profiled_sample, timed_decode
    from ..bench_unet import checkpoint_path, load_checkpoint
    from ..headless import boot

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
