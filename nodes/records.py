"""Optimization records carried on a patched MODEL clone, for the profiler report.

Each sdopt optimization node states what it requested and what is active on the
clone it returns. The list lives in ``model_options`` (plain dicts, so ComfyUI's
deep copy on clone keeps it), and the profiler copies it into every run it records.
What only becomes known during sampling is reported with
``optim.profiler.note_optimization``, which updates the same record.
"""
from __future__ import annotations

OPTIONS_KEY = "sdopt_optimizations"


def add_optimization_record(model_options: dict, node: str, requested: str, active: str, note: str = "") -> None:
    """Add or replace (by node and requested) the record of one optimization."""
    records = [
        r for r in model_options.get(OPTIONS_KEY, []) if not (r["node"] == node and r["requested"] == requested)
    ]
    records.append({"node": node, "requested": requested, "active": active, "note": note})
    model_options[OPTIONS_KEY] = records


def optimization_records(model_options: dict) -> list[dict]:
    return [dict(r) for r in model_options.get(OPTIONS_KEY, [])]
