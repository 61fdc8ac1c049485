"""The per-prompt context: the executing prompt and node, its profiled runs and records, per-node wall
time and peak memory through ComfyUI's progress registry (≈0.3.45 and newer), and events to the client
that queued it.

ComfyUI's execution context and progress registry are feature-detected, never read from a version string.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from ..measure.profiler import PeakMemory
from ..measure.record import record

_KEPT_PROMPTS = 16


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
    except ImportError:
        return ""
    return str(getattr(getattr(PromptServer, "instance", None), "last_prompt_id", None) or "")


def current_node_id() -> str | None:
    context = _executing_context()
    return context.node_id if context is not None else None


class PromptLog:
    """A prompt's profiled runs and the records of what ran outside sampling (VAE)."""

    def __init__(self):
        self.runs: list[dict] = []
        self.records: list[dict] = []


_prompts: OrderedDict[str, PromptLog] = OrderedDict()


def prompt_log(prompt_id: str | None = None) -> PromptLog:
    prompt_id = current_prompt_id() if prompt_id is None else prompt_id
    if prompt_id not in _prompts:
        _prompts[prompt_id] = PromptLog()
        while len(_prompts) > _KEPT_PROMPTS:
            _prompts.popitem(last=False)
    return _prompts[prompt_id]


def filing_records(fn: Callable) -> Callable:
    """``fn`` (a VAE copy's method) filing the copy's records into the executing prompt first."""
    def call(self, *args, **kwargs):
        for entry in self.sdopt_records:
            record(prompt_log().records, **entry)
        return fn(self, *args, **kwargs)

    return call


HANDLER_NAME = "sdopt.node_timing"


def _progress():
    try:
        from comfy_execution import progress
    except ImportError:
        return None
    return progress


def _timing_handler_class(progress):
    class NodeTimingHandler(progress.ProgressHandler):
        """Records each executed node's wall time and peak memory (cached nodes never start); under
        dynamic VRAM also what comfy-aimdo mapped past PyTorch's allocator, read as the node starts,
        at each of its progress updates (a sampler's steps) and as it finishes."""

        def __init__(self, device, outside_allocator=None):
            super().__init__(HANDLER_NAME)
            self.memory = PeakMemory(device, outside_allocator)
            self._started: dict[str, float] = {}
            self._class_types: dict[str, str] = {}
            self.nodes: list[dict] = []

        def set_registry(self, registry):
            prompt = registry.dynprompt.original_prompt
            self._class_types = {node_id: node["class_type"] for node_id, node in prompt.items()}

        def start_handler(self, node_id, state=None, prompt_id=None):
            self.memory.reset()
            self._started[node_id] = time.perf_counter()

        def update_handler(self, node_id, value, max_value, state, prompt_id, image=None):
            self.memory.sample()

        def finish_handler(self, node_id, state, prompt_id):
            started = self._started.pop(node_id, None)
            if started is not None:
                seconds = time.perf_counter() - started
                reading = self.memory.read()
                self.nodes.append({"id": str(node_id), "class_type": self._class_types.get(node_id, "?"), "seconds": seconds,
                                   "peak_memory_bytes": reading.peak_bytes, "peak_outside_allocator_bytes": reading.outside_allocator_bytes})

    return NodeTimingHandler


def _timing_handler(prompt_id: str):
    progress = _progress()
    if progress is None:
        return None
    registry = progress.get_progress_state()
    return registry.handlers.get(HANDLER_NAME) if registry.prompt_id == prompt_id else None


def install_node_timer(prompt_id: str, executing_node: str | None = None) -> bool:
    """Time the running prompt's nodes from now on, ``executing_node`` included.

    ComfyUI replaces its progress registry with every prompt, so this runs per prompt: from the
    profiler node, the profiled sampler and the headless runner. False where this ComfyUI cannot
    tell when nodes start and finish.
    """
    progress = _progress()
    if progress is None or progress.get_progress_state().prompt_id != prompt_id:
        return False
    if _timing_handler(prompt_id) is None:
        import comfy.model_management

        from .environment import dynamic_vram_probe

        device = comfy.model_management.get_torch_device()
        handler = _timing_handler_class(progress)(device, dynamic_vram_probe(device))
        progress.add_progress_handler(handler)
        if executing_node is not None:
            handler.start_handler(executing_node)
    return True


def node_timings(prompt_id: str) -> list[dict]:
    """The nodes of this prompt finished so far, in execution order."""
    handler = _timing_handler(prompt_id)
    return list(handler.nodes) if handler is not None else []


def send_to_client(event: str, data: dict) -> None:
    """Send a websocket event to the client that queued the prompt (the browser, or the headless runner)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_sync(event, data, getattr(server, "client_id", None))

