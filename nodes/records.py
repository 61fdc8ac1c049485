"""Optimization records and profiled runs, filed per prompt for the report node.

Each sdopt optimization node states what it requested and what is active on the
clone it returns (``add_optimization_record``). The list lives in ``model_options``
as plain dicts, so ComfyUI's deep copy on clone keeps it, and the profiler copies it
into every run it records. What only becomes known during sampling is reported with
``optim.profiler.note_optimization``, which updates the same record in the run.
What happens outside sampling (VAE decode/encode) goes to
``note_prompt_optimization``, filed under the prompt that is executing.
"""
from __future__ import annotations

from collections import OrderedDict

OPTIONS_KEY = "sdopt_optimizations"
_KEPT_PROMPTS = 16

_runs: OrderedDict[str, list[dict]] = OrderedDict()
_prompt_notes: OrderedDict[str, list[dict]] = OrderedDict()


def _upsert(records: list[dict], node: str, requested: str, active: str, note: str) -> list[dict]:
    kept = [r for r in records if not (r["node"] == node and r["requested"] == requested)]
    return kept + [{"node": node, "requested": requested, "active": active, "note": note}]


def add_optimization_record(model_options: dict, node: str, requested: str, active: str, note: str = "") -> None:
    """Add or replace (by node and requested) the record of one optimization on a clone."""
    model_options[OPTIONS_KEY] = _upsert(model_options.get(OPTIONS_KEY, []), node, requested, active, note)


def optimization_records(model_options: dict) -> list[dict]:
    return [dict(r) for r in model_options.get(OPTIONS_KEY, [])]


def _executing_context():
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    return get_executing_context()


def current_prompt_id() -> str:
    """The id of the prompt being executed, from ComfyUI's execution context where it has one."""
    context = _executing_context()
    if context is not None:
        return context.prompt_id
    try:
        from server import PromptServer
    except ImportError:  # headless, outside a prompt: there is no server to ask
        return ""
    instance = getattr(PromptServer, "instance", None)
    return str(getattr(instance, "last_prompt_id", None) or "")


def current_node_id() -> str | None:
    """The id of the node being executed, where this ComfyUI tells it."""
    context = _executing_context()
    return context.node_id if context is not None else None


def _bucket(store: OrderedDict, prompt_id: str) -> list[dict]:
    if prompt_id not in store:
        store[prompt_id] = []
        while len(store) > _KEPT_PROMPTS:
            store.popitem(last=False)
    return store[prompt_id]


def file_run(run: dict, prompt_id: str | None = None) -> None:
    _bucket(_runs, prompt_id if prompt_id is not None else current_prompt_id()).append(run)


def note_prompt_optimization(node: str, requested: str, active: str, note: str = "") -> None:
    """Record what an optimization did outside sampling, e.g. a VAE decode redone in fp32."""
    prompt_id = current_prompt_id()
    _prompt_notes[prompt_id] = _upsert(_bucket(_prompt_notes, prompt_id), node, requested, active, note)


def prompt_runs(prompt_id: str) -> list[dict]:
    return list(_runs.get(prompt_id, []))


def prompt_notes(prompt_id: str) -> list[dict]:
    return list(_prompt_notes.get(prompt_id, []))
