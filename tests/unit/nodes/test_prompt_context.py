"""nodes.prompt_context against fakes of ComfyUI's execution context, server and progress registry."""
import types
from collections import OrderedDict

import pytest
import torch

from sdopt.nodes import environment, prompt_context

from .comfy_fakes import PROMPT, install

pytestmark = pytest.mark.usefixtures("no_comfyui")


def test_prompt_log_keeps_the_latest_prompts(monkeypatch):
    monkeypatch.setattr(prompt_context, "_prompts", OrderedDict())
    logs = [prompt_context.prompt_log(str(i)) for i in range(prompt_context._KEPT_PROMPTS + 3)]
    assert list(prompt_context._prompts) == [str(i) for i in range(3, prompt_context._KEPT_PROMPTS + 3)]
    assert prompt_context.prompt_log(str(prompt_context._KEPT_PROMPTS + 2)) is logs[-1]


def test_current_prompt_and_node_ids(monkeypatch):
    assert prompt_context.current_prompt_id() == "" and prompt_context.current_node_id() is None, "no ComfyUI: no prompt"
    server = install(monkeypatch, "server", PromptServer=types.SimpleNamespace(instance=types.SimpleNamespace(last_prompt_id="from-server")))
    assert prompt_context.current_prompt_id() == "from-server"
    server.PromptServer.instance = None
    assert prompt_context.current_prompt_id() == ""
    context = types.SimpleNamespace(prompt_id="from-context", node_id="7")
    install(monkeypatch, "comfy_execution.utils", get_executing_context=lambda: context)
    assert prompt_context.current_prompt_id() == "from-context" and prompt_context.current_node_id() == "7"


class ProgressHandler:
    """comfy_execution.progress.ProgressHandler (≈0.3.45+), as far as the timer uses it."""

    def __init__(self, name):
        self.name, self.enabled = name, True

    def set_registry(self, registry):
        pass

    def start_handler(self, node_id, state, prompt_id):
        pass

    def update_handler(self, node_id, value, max_value, state, prompt_id, image=None):
        pass

    def finish_handler(self, node_id, state, prompt_id):
        pass


@pytest.fixture
def progress(monkeypatch):
    """A fake progress registry for prompt ``PROMPT`` whose graph has nodes 3 (KSampler) and 8 (VAEDecode)."""
    registry = types.SimpleNamespace(
        prompt_id=PROMPT, handlers={},
        dynprompt=types.SimpleNamespace(original_prompt={"3": {"class_type": "KSampler"}, "8": {"class_type": "VAEDecode"}}),
    )

    def add_progress_handler(handler):
        handler.set_registry(registry)
        registry.handlers[handler.name] = handler

    install(monkeypatch, "comfy_execution.progress", ProgressHandler=ProgressHandler, get_progress_state=lambda: registry,
            add_progress_handler=add_progress_handler)
    install(monkeypatch, "comfy.model_management", get_torch_device=lambda: torch.device("cpu"))
    return registry


def test_node_timer_times_the_executing_node_and_later_ones(progress):
    assert prompt_context.install_node_timer(PROMPT, "3") is True
    handler = progress.handlers[prompt_context.HANDLER_NAME]
    assert prompt_context.install_node_timer(PROMPT, "3") is True and progress.handlers[prompt_context.HANDLER_NAME] is handler, "one timer per prompt"
    handler.finish_handler("3", None, PROMPT)
    handler.start_handler("8", None, PROMPT)
    handler.finish_handler("8", None, PROMPT)
    handler.finish_handler("99", None, PROMPT)  # never started here (cached): not listed
    timings = prompt_context.node_timings(PROMPT)
    assert [(n["id"], n["class_type"]) for n in timings] == [("3", "KSampler"), ("8", "VAEDecode")]
    assert all(n["seconds"] >= 0 and n["peak_memory_bytes"] > 0 for n in timings)
    timings.clear()
    assert len(prompt_context.node_timings(PROMPT)) == 2, "callers get a copy"


def test_node_timer_adds_what_dynamic_vram_mapped(progress, monkeypatch):
    readings = iter(mib * 2**20 for mib in (1, 5, 3, 2))
    monkeypatch.setattr(environment, "dynamic_vram_probe", lambda device: lambda: next(readings))
    assert prompt_context.install_node_timer(PROMPT, "3") is True  # node 3 starts: 1 MiB mapped
    handler = progress.handlers[prompt_context.HANDLER_NAME]
    handler.finish_handler("3", None, PROMPT)  # 5 MiB
    handler.start_handler("8", None, PROMPT)  # 3 MiB: each node's peak starts afresh
    handler.finish_handler("8", None, PROMPT)  # 2 MiB
    assert [n["peak_outside_allocator_bytes"] for n in prompt_context.node_timings(PROMPT)] == [5 * 2**20, 3 * 2**20]


def test_node_timer_reads_dynamic_vram_at_each_progress_update_of_a_node(progress, monkeypatch):
    """A sampler maps weights in and lets pressure evict them between its steps: its peak is one of the steps'."""
    readings = iter(mib * 2**20 for mib in (1, 2, 9, 4, 3))
    monkeypatch.setattr(environment, "dynamic_vram_probe", lambda device: lambda: next(readings))
    prompt_context.install_node_timer(PROMPT, "3")  # 1 MiB as node 3 starts
    handler = progress.handlers[prompt_context.HANDLER_NAME]
    for step in (1, 2, 3):  # 2, 9, 4 MiB
        handler.update_handler("3", step, 3, None, PROMPT)
    handler.finish_handler("3", None, PROMPT)  # 3 MiB
    assert prompt_context.node_timings(PROMPT)[0]["peak_outside_allocator_bytes"] == 9 * 2**20


def test_node_timer_without_dynamic_vram_maps_nothing(progress):
    prompt_context.install_node_timer(PROMPT, "3")
    progress.handlers[prompt_context.HANDLER_NAME].finish_handler("3", None, PROMPT)
    assert prompt_context.node_timings(PROMPT)[0]["peak_outside_allocator_bytes"] is None


def test_node_timer_only_for_the_running_prompt(progress):
    assert prompt_context.install_node_timer("another prompt") is False and progress.handlers == {}
    assert prompt_context.node_timings("another prompt") == []
    assert prompt_context.install_node_timer(PROMPT) is True
    assert prompt_context.node_timings(PROMPT) == [], "no node has finished yet"


def test_node_timer_without_a_progress_registry():
    assert prompt_context.install_node_timer(PROMPT, "3") is False and prompt_context.node_timings(PROMPT) == []
