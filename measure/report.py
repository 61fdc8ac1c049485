"""The profile report: JSON (schema in docs/report-schema.md), a markdown table and a PNG chart.

The chart needs matplotlib, an optional dependency: without it ``save_chart`` returns None and
the report carries a note naming the install command, so the table still reaches the user.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .profiler import MEMORY_LABELS, MIB, format_mib

SCHEMA_VERSION = 2
CHART_MISSING = "chart not drawn: matplotlib is not installed (pip install matplotlib)"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def markdown_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> list[str]:
    """A markdown table's lines; columns whose index is in ``right`` are right-aligned."""
    rule = ["---:" if i in right else "---" for i in range(len(headers))]
    return ["| " + " | ".join(map(str, line)) + " |" for line in (headers, rule, *rows)]


# Report.memory_mode: how ComfyUI managed memory in the process (None: a ComfyUI without dynamic VRAM).
DYNAMIC_VRAM, CLASSIC_MEMORY = "dynamic VRAM", "classic memory"


@dataclass
class Report:
    device: str
    comfyui: str | None = None
    memory_mode: str | None = None
    runs: list[dict] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)
    optimizations: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cached: bool = False
    torch: str = torch.__version__

    def to_dict(self) -> dict:
        return {
            "sdopt_report": SCHEMA_VERSION,
            "device": self.device,
            "torch": self.torch,
            "comfyui": self.comfyui,
            "memory_mode": self.memory_mode,
            "cached": self.cached,
            "runs": self.runs,
            "nodes": self.nodes,
            "optimizations": self.optimizations,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        if data.get("sdopt_report") != SCHEMA_VERSION:
            raise ValueError(f"not an sdopt report (schema {SCHEMA_VERSION})")
        return cls(
            device=data["device"],
            comfyui=data.get("comfyui"),
            memory_mode=data.get("memory_mode"),
            runs=list(data.get("runs", [])),
            nodes=list(data.get("nodes", [])),
            optimizations=list(data.get("optimizations", [])),
            notes=list(data.get("notes", [])),
            cached=bool(data.get("cached", False)),
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

    def save_chart(self, path: str | Path) -> Path | None:
        """The chart as a PNG at ``path``; None (and a note in the report) without matplotlib."""
        if importlib.util.find_spec("matplotlib") is None:
            if CHART_MISSING not in self.notes:
                self.notes.append(CHART_MISSING)
            return None
        return render_chart(self, path)


def outside_allocator_suffix(outside_allocator: int | None) -> str:
    """What a peak-memory cell adds for memory mapped past PyTorch's allocator (dynamic VRAM)."""
    return f" + {format_mib(outside_allocator)} dynamic VRAM" if outside_allocator is not None else ""


def _memory(bytes_: int | None, kind: str, outside_allocator: int | None = None) -> str:
    return f"{format_mib(bytes_)} ({MEMORY_LABELS.get(kind, kind)}){outside_allocator_suffix(outside_allocator)}"


def _steady(run: dict) -> str:
    """The steady rate, flagged where no step after the first was free of warm-up."""
    rate = run["steady_it_per_s"]
    if rate is None:
        return "-"
    return f"{rate:.2f}" + (" (first step only)" if run.get("steady_steps") == [0] else "")


def _warmup_steps(run: dict) -> str:
    """The steps left out of the steady rate for compiling or capturing, with the seconds of each."""
    spent = [
        f"{step['index']}: " + ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in step["warmup"].items())
        for step in run["steps"] if step.get("warmup")
    ]
    return "; ".join(spent) or "-"


SHORT_HEADER = "did less than asked"


def _recipe(run: dict, leave_out: set[str]) -> tuple:
    return run.get("model_family"), sorted((o["node"], o["requested"]) for o in run.get("optimizations", []) if o["node"] not in leave_out)


def eager_twin(run: dict, runs: list[dict]) -> dict | None:
    """The last other run of ``runs`` with ``run``'s nodes and settings but none of the nodes that only
    made ``run`` faster (its ``speed_only_nodes``: compile, CUDA graphs), where ``run`` has one and the
    twin has a steady rate; None otherwise. Such a run has an eager twin, whose steady rate the report
    shows beside its own."""
    speed_only = set(run.get("speed_only_nodes") or ())
    if not speed_only:
        return None
    twins = [other for other in runs if other is not run and other.get("steady_it_per_s") and not other.get("speed_only_nodes")
             and not any(o["node"] in speed_only for o in other.get("optimizations", []))
             and _recipe(other, speed_only) == _recipe(run, speed_only)]
    return twins[-1] if twins else None


def _beside_twin(run: dict, runs: list[dict]) -> str:
    twin = eager_twin(run, runs)
    if twin is None:
        return "-"
    rate = f"{twin['steady_it_per_s']:.2f} it/s ({twin['label']})"
    return f"{rate}, {run['steady_it_per_s'] / twin['steady_it_per_s']:.2f}x" if run.get("steady_it_per_s") else rate


def render_markdown(report: Report) -> str:
    memory = f" ({report.memory_mode})" if report.memory_mode else ""
    lines = [f"sdopt profile: device {report.device}, torch {report.torch}, ComfyUI {report.comfyui or '-'}{memory}", ""]
    lines += [*report.notes, ""] if report.notes else []
    if not report.runs:
        lines.append("No sampling run was profiled (is SDOptProfiler on the MODEL path?).")
    else:
        twins = any(eager_twin(run, report.runs) for run in report.runs)
        lines += markdown_table(
            ["run", "steps", "first step s", "steady it/s", "warm-up steps", "sampler total s", "peak memory MiB", "model"]
            + (["eager twin's steady it/s"] if twins else []),
            [
                [
                    run["label"], len(run["steps"]), f"{run['first_step_s']:.3f}", _steady(run), _warmup_steps(run),
                    f"{run['sampler_total_s']:.3f}", _memory(run["peak_memory_bytes"], run["memory_kind"], run.get("peak_outside_allocator_bytes")),
                    run.get("model_family") or "-",
                ] + ([_beside_twin(run, report.runs)] if twins else [])
                for run in report.runs
            ],
            right={1, 2, 3, 5, 6},
        )
    records = [(run["label"], o) for run in report.runs for o in run.get("optimizations", [])]
    records += [("(outside sampling)", o) for o in report.optimizations]
    if records:
        short = any(o.get("short") for _, o in records)
        lines += ["", *markdown_table(
            ["run", "optimization", "requested", "active"] + ([SHORT_HEADER] if short else []) + ["note"],
            [[label, o["node"], o["requested"], o["active"]] + ([o.get("short") or "-"] if short else []) + [o["note"]]
             for label, o in records],
        )]
    if report.nodes:
        lines += ["", *markdown_table(
            ["node", "class", "seconds", "peak memory MiB"],
            [[n["id"], n["class_type"], f"{n['seconds']:.3f}",
              format_mib(n["peak_memory_bytes"]) + outside_allocator_suffix(n.get("peak_outside_allocator_bytes"))] for n in report.nodes],
            right={2, 3},
        )]
    return "\n".join(lines)


def render_chart(report: Report, path: str | Path) -> Path:
    """Where the prompt's time and memory went, as a PNG sized to be read at the report node's width:
    per-node wall time and peak memory as bars, and each run's per-step times."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nodes = report.nodes
    with plt.rc_context({"font.size": 12, "axes.titlesize": 13}):
        fig, (time_ax, memory_ax, steps_ax) = plt.subplots(
            3, 1, figsize=(6.4, 3.2 + 0.5 * max(len(nodes), 2) * 2), dpi=100, layout="constrained",
            height_ratios=[max(len(nodes), 2), max(len(nodes), 2), 3],
        )
        names = [f"{n['id']} {n['class_type']}" for n in nodes]
        kind = MEMORY_LABELS.get((report.runs or [{}])[0].get("memory_kind", ""), "memory")
        for ax, values, title, color, fmt in (
            (time_ax, [n["seconds"] for n in nodes], "Wall time per node (s)", "tab:blue", "{:.2f}"),
            (memory_ax, [(n["peak_memory_bytes"] or 0) / MIB for n in nodes], f"Peak {kind} per node (MiB)", "tab:orange", "{:,.0f}"),
        ):
            ax.set_title(title, loc="left")
            if nodes:
                bars = ax.barh(range(len(nodes)), values, color=color, tick_label=names)
                ax.bar_label(bars, fmt=fmt, padding=3)
                ax.invert_yaxis()
                ax.margins(x=0.2)
            else:
                ax.text(0.5, 0.5, "no per-node figures on this ComfyUI", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
        warmed = False
        for run in report.runs:
            (line,) = steps_ax.plot([s["index"] for s in run["steps"]], [s["seconds"] for s in run["steps"]], marker="o", label=run["label"])
            for step in (s for s in run["steps"] if s.get("warmup")):
                warmed = True
                steps_ax.plot(step["index"], step["seconds"], marker="X", markersize=11, color=line.get_color())
                steps_ax.annotate(" + ".join(step["warmup"]), (step["index"], step["seconds"]), xytext=(7, 0),
                                  textcoords="offset points", va="center", fontsize="small")
        if warmed:
            # a compile step can be a hundred steady steps long: on a linear axis the steady ones flatten out
            steps_ax.set_yscale("log")
        title = "Time per sampler step (s, log; X: warm-up, not in steady it/s)" if warmed else "Time per sampler step (s)"
        steps_ax.set_title(title, loc="left")
        steps_ax.set_xlabel("step")
        steps_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if report.runs:
            steps_ax.legend(fontsize="small")
        title = f"sdopt profile on {report.device}" + (" (cached: last real figures)" if report.cached else "")
        fig.suptitle(title)
        fig.savefig(path)
        plt.close(fig)
    return path
