"""Per-node wall time and peak memory for a prompt, through ComfyUI's progress registry.

ComfyUI (since ≈0.3.45) tells every registered ``ProgressHandler`` when a node starts
and finishes. Older versions have no registry: ``install_node_timer`` then returns
False and reports simply carry no per-node list. The registry is replaced at the
start of every prompt, so the timer is installed per prompt: by the headless runner
as soon as a prompt starts, and, in the browser, by ``SDOptProfiler`` when it runs and
by the profiled sampler when that starts (so a cached profiler node still gets one).
Installed mid-prompt, it sees the node that is executing from that moment on, and
every node after it.
"""
from __future__ import annotations

import time

from ..optim.profiler import PeakMemory

try:
    from comfy_execution.progress import ProgressHandler, add_progress_handler, get_progress_state
except ImportError:
    ProgressHandler = None

HANDLER_NAME = "sdopt.node_timing"


def _device():
    import comfy.model_management

    return comfy.model_management.get_torch_device()


if ProgressHandler is not None:

    class NodeTimingHandler(ProgressHandler):
        """Records each executed node's wall time and peak memory (cached nodes never start)."""

        def __init__(self):
            super().__init__(HANDLER_NAME)
            self.memory = PeakMemory(_device())
            self._started: dict[str, float] = {}
            self._class_types = {}
            self.nodes: list[dict] = []

        def set_registry(self, registry):
            self._class_types = {
                node_id: node["class_type"] for node_id, node in registry.dynprompt.original_prompt.items()
            }

        def start_handler(self, node_id, state=None, prompt_id=None):
            self.memory.reset()
            self._started[node_id] = time.perf_counter()

        def finish_handler(self, node_id, state, prompt_id):
            started = self._started.pop(node_id, None)
            if started is None:
                return
            self.nodes.append(
                {
                    "id": str(node_id),
                    "class_type": self._class_types.get(node_id, "?"),
                    "seconds": time.perf_counter() - started,
                    "peak_memory_bytes": self.memory.read().peak_bytes,
                }
            )


def _handler(prompt_id: str):
    if ProgressHandler is None:
        return None
    registry = get_progress_state()
    if registry.prompt_id != prompt_id:
        return None
    return registry.handlers.get(HANDLER_NAME)


def install_node_timer(prompt_id: str, executing_node: str | None = None) -> bool:
    """Start timing the nodes of the running prompt, ``executing_node`` from now on.

    False where this ComfyUI cannot tell us when nodes start and finish.
    """
    if ProgressHandler is None or get_progress_state().prompt_id != prompt_id:
        return False
    if _handler(prompt_id) is None:
        handler = NodeTimingHandler()
        add_progress_handler(handler)
        if executing_node is not None:
            handler.start_handler(executing_node)
    return True


def node_timings(prompt_id: str) -> list[dict]:
    """The nodes of this prompt finished so far, in execution order."""
    handler = _handler(prompt_id)
    return list(handler.nodes) if handler is not None else []
