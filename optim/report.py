"""The profile report: JSON (schema in docs/report-schema.md), a markdown table and a PNG chart."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .profiler import MEMORY_VRAM

SCHEMA_VERSION = 1
_MIB = 1024 * 1024


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


@dataclass
class Report:
    device: str
    comfyui: str | None = None
    runs: list[dict] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)
    optimizations: list[dict] = field(default_factory=list)
    note: str | None = None
    torch: str = torch.__version__

    def to_dict(self) -> dict:
        return {
            "sdopt_report": SCHEMA_VERSION,
            "device": self.device,
            "torch": self.torch,
            "comfyui": self.comfyui,
            "runs": self.runs,
            "nodes": self.nodes,
            "optimizations": self.optimizations,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        if data.get("sdopt_report") != SCHEMA_VERSION:
            raise ValueError(f"not an sdopt report (schema {SCHEMA_VERSION})")
        return cls(
            device=data["device"],
            comfyui=data.get("comfyui"),
            runs=list(data.get("runs", [])),
            nodes=list(data.get("nodes", [])),
            optimizations=list(data.get("optimizations", [])),
            note=data.get("note"),
            torch=data["torch"],
        )

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)
        return path

    def markdown(self) -> str:
        return render_markdown(self)

    def save_chart(self, path: str | Path) -> Path:
        return render_chart(self, path)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:,.1f}"


def _memory_label(kind: str) -> str:
    return "VRAM" if kind == MEMORY_VRAM else "RAM"


def render_markdown(report: Report) -> str:
    lines = [f"sdopt profile: device {report.device}, torch {report.torch}, ComfyUI {report.comfyui or '-'}", ""]
    if not report.runs:
        lines.append(report.note or "No sampling run was profiled (is SDOptProfiler on the MODEL path?).")
    else:
        lines += [
            "| run | steps | first step s | steady it/s | sampler total s | peak memory MiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for run in report.runs:
            lines.append(
                f"| {run['label']} | {len(run['steps'])} | {run['first_step_s']:.3f} | "
                f"{run['steady_it_per_s']:.2f} | {run['sampler_total_s']:.3f} | "
                f"{_mib(run['peak_memory_bytes'])} ({_memory_label(run['memory_kind'])}) |"
            )
    optimizations = [(run["label"], o) for run in report.runs for o in run.get("optimizations", [])]
    optimizations += [("(outside sampling)", o) for o in report.optimizations]
    if optimizations:
        lines += ["", "| run | optimization | requested | active | note |", "|---|---|---|---|---|"]
        for label, o in optimizations:
            lines.append(f"| {label} | {o['node']} | {o['requested']} | {o['active']} | {o['note']} |")
    if report.nodes:
        lines += ["", "| node | class | seconds | peak memory MiB |", "|---|---|---:|---:|"]
        for node in report.nodes:
            lines.append(
                f"| {node['id']} | {node['class_type']} | {node['seconds']:.3f} | {_mib(node['peak_memory_bytes'])} |"
            )
    return "\n".join(lines)


def render_chart(report: Report, path: str | Path) -> Path:
    """Per-step time for every run beside each run's peak memory, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (steps_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for run in report.runs:
        steps_ax.plot(
            [s["index"] for s in run["steps"]], [s["seconds"] for s in run["steps"]], marker="o", label=run["label"]
        )
    steps_ax.set(title="Time per sampler step", xlabel="step", ylabel="seconds")
    steps_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if report.runs:
        steps_ax.legend(fontsize="small")
    labels = [run["label"] for run in report.runs]
    peaks = [run["peak_memory_bytes"] / _MIB for run in report.runs]
    memory_ax.bar(range(len(peaks)), peaks, tick_label=labels)
    kinds = {_memory_label(run["memory_kind"]) for run in report.runs}
    memory_ax.set(title=f"Peak {'/'.join(sorted(kinds)) or 'memory'}", ylabel="MiB")
    fig.suptitle(f"sdopt profile on {report.device}")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
