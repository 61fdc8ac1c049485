"""The one optimization record: what a node requested and what is active, filed by one function.

Records live as plain dicts in plain lists (a clone's ``model_options``, a VAE copy, a sampling
run, a prompt), because ComfyUI copies ``model_options`` with a deep copy (0.3.x) or a copy of
its dicts and lists only (0.38); either way each clone gets its own records.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OptimizationRecord:
    """What one optimization node asked for, what really runs, and why they differ; ``short`` is
    one line where the node did less than asked (a fallback, parts that ran eagerly), "" otherwise."""

    node: str
    requested: str
    active: str
    note: str = ""
    short: str = ""


def record(records: list[dict], node: str, requested: str, active: str, note: str = "", short: str = "") -> OptimizationRecord:
    """File a record into ``records`` in place, replacing the one of the same node (a node chained
    twice ends with the second one's settings), and return it."""
    entry = OptimizationRecord(node, requested, active, note, short)
    records[:] = [r for r in records if r["node"] != node] + [asdict(entry)]
    return entry
