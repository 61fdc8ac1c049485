"""Headless runner: boot ComfyUI in this process with sdopt loaded, run a workflow, collect the report.

``python -m sdopt run`` calls ``run_workflow``; the host test tier uses ``boot`` and
``ComfyHost`` directly. ComfyUI is imported from the given folder (never vendored),
with ``--cpu`` when CUDA is absent, its core nodes, and this pack loaded through
ComfyUI's own ``load_custom_node``, exactly as a ``custom_nodes`` install would be.
The runner stands in for ComfyUI's server: it receives the report node's ``sdopt.report``
event, as the browser does, and never builds a report of its own; it only adds a note to it when
``--vram-cap`` was in force.

ComfyUI's memory mode is the one its own server would start on this machine (``--memory-mode auto``):
ComfyUI 0.38's dynamic VRAM on an NVIDIA GPU (or AMD on ROCm 7.14+) where this ComfyUI offers it and
comfy-aimdo is installed, classic memory management elsewhere; ``classic`` and ``dynamic`` choose
(``memory_mode.py``).

``--vram-cap`` (``boot(..., vram_cap=...)``, applied right after ComfyUI boots, before any model
loads) emulates a smaller GPU on a larger one: PyTorch's caching allocator may hold only
``cap / total`` of the device, and ComfyUI's ``get_free_memory`` answers for the capped device as a
GPU of the cap's size would (at most the cap less what live tensors hold), so that every plan ComfyUI
makes from free memory (where to build a model, how much of it to load) sees the cap. ComfyUI's
reserved VRAM stays what the user set: the nodes subtract it from free memory, as on a real card.
ComfyUI's dtype heuristics and VRAM mode, read from the device total at start, still see the whole GPU.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import gc
import importlib
import inspect
import logging
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from ..measure.report import Report
from ..measure.memory_model import parse_bytes
from .memory_mode import AUTO, MemoryModeStart, requested_mode
from .workflow import (
    apply_overrides,
    is_ui_format,
    load_workflow,
    ui_to_api,
    unknown_types_message,
    validation_message,
)

PACK_ROOT = Path(__file__).resolve().parents[1]
REPORT_NODE = "SDOptProfileReport"
REPORT_EVENT = "sdopt.report"
CLIENT_ID = "sdopt-headless"
# What ComfyUI's own server passes as cache_args where PromptExecutor takes them (0.3.75 and newer).
CACHE_ARGS = {"lru": 0, "ram": 0, "ram_inactive": 0}


_GiB = 2**30


@dataclass(frozen=True)
class VramCap:
    """``--vram-cap`` as planned for one device: ``total_bytes`` is None where the device is not a
    CUDA GPU, and then the cap is ignored."""

    cap_bytes: int
    device: str
    total_bytes: int | None = None
    comfy_plans_for_cap: bool = True  # False: this ComfyUI has no get_free_memory to answer within the cap
    dynamic_vram: bool = False  # ComfyUI 0.38's dynamic VRAM maps weights past PyTorch's allocator

    @property
    def in_force(self) -> bool:
        return self.total_bytes is not None

    @property
    def fraction(self) -> float:
        """What ``torch.cuda.set_per_process_memory_fraction`` gets."""
        return self.cap_bytes / self.total_bytes

    def note(self) -> str:
        if not self.in_force:
            return (f"--vram-cap {self.cap_bytes / _GiB:,.2f} GiB ignored: the cap applies to CUDA GPUs only, "
                    f"and this run is on {self.device}")
        capped = (f"VRAM capped at {self.cap_bytes / _GiB:,.2f} GiB of {self.device}'s {self.total_bytes / _GiB:,.2f} GiB "
                  f"(--vram-cap): PyTorch may allocate {self.fraction:.3f} of it")
        if self.comfy_plans_for_cap:
            capped += ", and ComfyUI's free memory stays within it"
        else:
            capped += "; this ComfyUI has no get_free_memory, so its model loading plans for the whole GPU"
        if self.dynamic_vram:
            capped += "; ComfyUI's dynamic VRAM maps weights past PyTorch's allocator, and the cap does not bound those"
        return capped


def plan_vram_cap(cap_bytes: int, device: str, device_total=None) -> VramCap:
    """The cap for ``device``; ``device_total()`` gives its memory in bytes, and is None where the
    device is no CUDA GPU. A cap above the device's memory is a ``UserError``."""
    if device_total is None:
        return VramCap(cap_bytes, device)
    total = device_total()
    if cap_bytes > total:
        raise UserError(f"--vram-cap {cap_bytes / _GiB:,.2f} GiB is more than {device}'s {total / _GiB:,.2f} GiB: "
                        "give a smaller size, or leave --vram-cap out to use the whole GPU")
    return VramCap(cap_bytes, device, total)


def parse_vram_cap(text: str | None) -> int | None:
    """Bytes of a ``--vram-cap`` value (``8GiB``, ``6000MiB``); None without one."""
    return None if text is None else parse_bytes(text, "--vram-cap")


def capped_free_memory(get_free_memory, cap_bytes: int, capped_device, live_bytes):
    """ComfyUI's ``get_free_memory(dev=None, torch_free_too=False)`` as a GPU of ``cap_bytes`` would
    answer it: on ``capped_device`` (the default device), free memory is at most the cap less
    ``live_bytes(device)``, the bytes live tensors hold; other devices answer as before."""
    import torch

    capped = torch.device(capped_device)

    def get_capped_free_memory(dev=None, torch_free_too=False):
        answer = get_free_memory(dev, torch_free_too)
        device = capped if dev is None else torch.device(dev)
        if device.type != capped.type or (device.index or 0) != (capped.index or 0):
            return answer
        free_total, free_torch = answer if torch_free_too else (answer, None)
        free_total = min(free_total, max(cap_bytes - live_bytes(device), 0))
        return (free_total, min(free_torch, free_total)) if torch_free_too else free_total

    get_capped_free_memory.uncapped = get_free_memory
    return get_capped_free_memory


@dataclass
class WorkflowOutcome:
    report: Report | None
    images: list[Path]
    prompt: dict
    report_path: Path | None = None
    outputs: dict = field(default_factory=dict)


class _Server:
    """Stands in for PromptServer: keeps the events and starts the node timer with each prompt."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata = {}
        self.events: list[tuple[str, dict]] = []

    def send_sync(self, event, data, sid=None):
        self.events.append((event, data))
        # execution_cached is the first event after ComfyUI resets the progress registry.
        if event == "execution_cached":
            from ..nodes.prompt_context import install_node_timer

            install_node_timer(data["prompt_id"])

    def send_progress_text(self, text, node_id, sid=None):
        pass

    def queue_updated(self):
        pass

    def reports(self) -> list[dict]:
        return [data for event, data in self.events if event == REPORT_EVENT]


def _progress_to_registry(value, total, preview_image, prompt_id=None, node_id=None):
    """What a server's progress hook (main.py's) does that nodes see: each ProgressBar update of the
    executing node reaches ComfyUI's progress registry, whose handlers (sdopt's node timer, which
    samples memory per sampler step) run on it. The browser's events have no one to go to here."""
    from comfy_execution.progress import get_progress_state
    from comfy_execution.utils import get_executing_context

    context = get_executing_context()
    node_id = node_id if node_id is not None else getattr(context, "node_id", None)
    if node_id is not None:
        get_progress_state().update_progress(node_id, value, total, preview_image)


@contextlib.contextmanager
def _quiet_logging():
    """ComfyUI logs validation problems itself; the runner reports them as one line instead."""
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _quiet_user_errors(user_errors: tuple[type, ...]):
    """ComfyUI logs a failing node's exception with its traceback; where the exception is a
    ``UserError`` the runner prints its one line instead. Every other exception is logged as ever."""

    def outside_user_error(_record) -> bool:
        return not isinstance(sys.exc_info()[1], user_errors)

    root = logging.getLogger()
    root.addFilter(outside_user_error)
    try:
        yield
    finally:
        root.removeFilter(outside_user_error)


def _check_comfyui(path: Path | None) -> Path:
    if path is None:
        raise UserError("ComfyUI not found: pass --comfyui /path/to/ComfyUI or set COMFYUI_PATH")
    path = Path(path).expanduser().resolve()
    if not (path / "comfy" / "model_patcher.py").is_file() or not (path / "execution.py").is_file():
        raise UserError(
            f"ComfyUI not found at {path} (no comfy/model_patcher.py there): "
            "pass --comfyui /path/to/ComfyUI or set COMFYUI_PATH"
        )
    return path


class ComfyHost:
    """ComfyUI booted in this process, with its core nodes and sdopt registered."""

    def __init__(self, path: Path, memory_mode: str = AUTO):
        self.path = path
        argv = sys.argv
        sys.path.insert(0, str(path))
        import torch

        cuda = torch.cuda.is_available()
        sys.argv = ["main.py"] + ([] if cuda else ["--cpu"])
        memory = MemoryModeStart(memory_mode, cuda)
        try:
            import comfy.options

            comfy.options.enable_args_parsing()
            memory.load_library()
            # Before nodes, as in main.py: importing nodes puts comfy/ on sys.path, whose utils.py hides ComfyUI's utils/.
            importlib.import_module("utils")

            import execution
            import folder_paths
            import nodes
            import server
        finally:
            sys.argv = argv
        self.memory_mode = memory.take_devices()
        self._execution, self._folder_paths, self._nodes = execution, folder_paths, nodes
        import comfy.utils

        # ComfyUI's samplers also draw a tqdm bar on the console; off a terminal it is only partial
        # lines and escape codes in a log. Its ProgressBar (the browser's) is another thing, left on.
        comfy.utils.set_progress_bar_enabled(sys.stderr.isatty())
        if hasattr(comfy.utils, "set_progress_bar_global_hook"):
            comfy.utils.set_progress_bar_global_hook(_progress_to_registry)
        with _quiet_logging():
            asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
            loaded = asyncio.run(nodes.load_custom_node(str(PACK_ROOT)))
        if not loaded or REPORT_NODE not in nodes.NODE_CLASS_MAPPINGS:
            raise RuntimeError(f"ComfyUI at {path} could not load sdopt from {PACK_ROOT}")
        self._server = _Server()
        if getattr(server.PromptServer, "instance", None) is None:
            server.PromptServer.instance = self._server
        options = {"cache_args": CACHE_ARGS} if "cache_args" in inspect.signature(execution.PromptExecutor).parameters else {}
        self._executor = execution.PromptExecutor(self._server, cache_type=execution.CacheType.CLASSIC, **options)
        self.vram_cap: VramCap | None = None

    @property
    def vram_cap_bytes(self) -> int | None:
        """The VRAM cap in force, in bytes; None without one (or where it was ignored)."""
        return self.vram_cap.cap_bytes if self.vram_cap is not None and self.vram_cap.in_force else None

    def set_vram_cap(self, cap_bytes: int | None) -> VramCap | None:
        """Cap the VRAM this process may use at ``cap_bytes`` (None: the whole device again)."""
        import comfy.model_management as mm
        import torch

        device = mm.get_torch_device()
        cuda = torch.device(device).type == "cuda"
        if self.vram_cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            mm.get_free_memory = getattr(mm.get_free_memory, "uncapped", mm.get_free_memory)
        if cap_bytes is None:
            self.vram_cap = None
            return None
        name = torch.cuda.get_device_name(device) if cuda else str(device)
        total = (lambda: torch.cuda.mem_get_info(device)[1]) if cuda else None
        cap = plan_vram_cap(cap_bytes, name, total)
        if cap.in_force:
            from ..nodes.environment import dynamic_vram_probe

            torch.cuda.set_per_process_memory_fraction(cap.fraction, device)
            plans = callable(getattr(mm, "get_free_memory", None))
            if plans:
                mm.get_free_memory = capped_free_memory(mm.get_free_memory, cap_bytes, device, torch.cuda.memory_allocated)
            cap = replace(cap, comfy_plans_for_cap=plans, dynamic_vram=dynamic_vram_probe(device) is not None)
        self.vram_cap = cap
        return cap

    @property
    def node_classes(self) -> dict:
        return self._nodes.NODE_CLASS_MAPPINGS

    def pack(self, name: str):
        """Module ``name`` (e.g. ``"nodes.patching"``) of the pack as ComfyUI loaded it: ComfyUI imports the
        pack under a module name of its own, so that copy holds the state the nodes use."""
        package = self.node_classes[REPORT_NODE].__module__.rsplit(".nodes.", 1)[0]
        return importlib.import_module(f"{package}.{name}")

    def clear_cache(self) -> None:
        """Forget cached node outputs, so the next prompt runs every node."""
        self._executor.reset()

    def release(self) -> None:
        """Drop every model this ComfyUI holds (the cached node outputs, its loaded models) and collect,
        while ComfyUI's modules are still there: a ModelPatcher left to the interpreter's exit finds them
        torn down in its ``__del__`` and prints a traceback ("'NoneType' object has no attribute
        'ON_DETACH'"), as `bench speed` and `bench resolutions` did at their end on a GPU."""
        import comfy.model_management

        self.clear_cache()
        comfy.model_management.unload_all_models()
        gc.collect()

    def add_models_folder(self, folder: Path) -> None:
        """Search ``folder`` for checkpoints, and ``folder/<kind>`` for every other model kind."""
        folder = Path(folder).resolve()
        if not folder.is_dir():
            raise UserError(f"--models {folder} is not a folder: pass the folder that holds your checkpoints")
        self._folder_paths.add_model_folder_path("checkpoints", str(folder))
        for kind in list(self._folder_paths.folder_names_and_paths):
            if (folder / kind).is_dir():
                self._folder_paths.add_model_folder_path(kind, str(folder / kind))

    def set_output_folder(self, folder: Path) -> None:
        folder = Path(folder).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self._folder_paths.set_output_directory(str(folder))

    def definitions(self) -> dict:
        """Input definitions of every registered node, in the shape of ComfyUI's /object_info."""
        definitions = {}
        for name, cls in self.node_classes.items():
            try:
                inputs = cls.INPUT_TYPES()
            except Exception:  # a broken third-party definition must not stop other workflows
                continue
            definitions[name] = {
                "input": inputs,
                "input_order": {key: list(value) for key, value in inputs.items() if isinstance(value, dict)},
            }
        return definitions

    def prompt_from(self, workflow: dict, overrides: list[str] = ()) -> dict:
        """The API prompt for a UI or API workflow, with ``--set`` overrides applied."""
        definitions = self.definitions()
        prompt = ui_to_api(workflow, definitions) if is_ui_format(workflow) else copy.deepcopy(workflow)
        unknown = sorted({node["class_type"] for node in prompt.values()} - set(definitions))
        if unknown:
            raise UserError(unknown_types_message(unknown))
        return apply_overrides(prompt, list(overrides), definitions)

    def _validate(self, prompt_id: str, prompt: dict) -> list[str]:
        with _quiet_logging():
            ok, error, outputs, node_errors = asyncio.run(self._execution.validate_prompt(prompt_id, prompt, None))
        for node_id, entry in node_errors.items():
            for reason in entry["errors"]:
                raise UserError(
                    validation_message(node_id, entry["class_type"], reason, self._folder_paths.get_folder_paths("checkpoints"))
                )
        if not ok:
            raise UserError(f"{error['message']}: {error['details']}".strip().rstrip(":"))
        return outputs

    def execute(self, prompt: dict) -> WorkflowOutcome:
        """Validate and run an API prompt; the outcome carries the report of its report node, if it has one."""
        prompt_id = uuid.uuid4().hex
        outputs = self._validate(prompt_id, prompt)
        self._server.events.clear()
        # ComfyUI writes is_changed results into the prompt it runs, so it gets a copy.
        with _quiet_user_errors((UserError, self.pack("errors").UserError)):
            asyncio.run(
                self._executor.execute_async(
                    copy.deepcopy(prompt), prompt_id, extra_data={"client_id": CLIENT_ID}, execute_outputs=outputs
                )
            )
        if not self._executor.success:
            raise UserError(self._failure_message())
        history = self._executor.history_result["outputs"]
        reports = self._server.reports()
        report = Report.from_dict(reports[-1]["report"]) if reports else None
        return WorkflowOutcome(
            report=report,
            images=self._images(history),
            prompt=prompt,
            report_path=Path(reports[-1]["path"]) if reports else None,
            outputs=history,
        )

    def _failure_message(self) -> str:
        for event, data in reversed(self._server.events):
            if event == "execution_error":
                where, message = f"node {data['node_id']} ({data['node_type']})", data["exception_message"].strip()
                if data["exception_type"] == f"{UserError.__module__}.{UserError.__qualname__}":
                    return f"{where}: {message}"
                return f"{where} failed: {data['exception_type']}: {message}"
            if event == "execution_interrupted":
                return f"the run was interrupted at node {data['node_id']} ({data['node_type']})"
        return "the workflow failed (see ComfyUI's log above)"

    def _images(self, history: dict) -> list[Path]:
        images = []
        for output in history.values():
            for image in output.get("images", []):
                folder = self._folder_paths.get_directory_by_type(image.get("type", "output"))
                if folder is not None:
                    images.append(Path(folder) / image.get("subfolder", "") / image["filename"])
        return images


_host: ComfyHost | None = None


def boot(comfyui: str | Path | None, vram_cap: int | None = None, memory_mode: str | None = None) -> ComfyHost:
    """The process's ComfyUI host, booted on first use; one ComfyUI per process. ``vram_cap``
    (bytes) caps its VRAM from now on, None lifts a cap; the cap's line goes to stderr. ``memory_mode``
    (auto, dynamic or classic; default ``$SDOPT_MEMORY_MODE``, else auto) is the process's, chosen at
    its first boot."""
    global _host
    path = _check_comfyui(Path(comfyui) if comfyui else None)
    mode = requested_mode(memory_mode)
    if _host is None:
        _host = ComfyHost(path, mode)
        atexit.register(_host.release)  # atexit runs before the interpreter tears modules down
    elif _host.path != path:
        raise UserError(f"ComfyUI from {_host.path} is already loaded in this process; cannot switch to {path}")
    elif mode != _host.memory_mode.requested:
        raise UserError(f"ComfyUI is already loaded in this process with --memory-mode {_host.memory_mode.requested}; "
                        f"--memory-mode {mode} needs a process of its own")
    cap = _host.set_vram_cap(vram_cap)
    if cap is not None:
        print(f"sdopt: {cap.note()}", file=sys.stderr)
    return _host


def memory_mode_text() -> str:
    """How this process's ComfyUI manages memory, for a bench's header: the mode that started, or
    the one asked for where ComfyUI has not booted yet."""
    if _host is None:
        return f"--memory-mode {requested_mode()}"
    return _host.memory_mode.label or "a ComfyUI without dynamic VRAM"


def run_workflow(
    workflow_path: str | Path,
    comfyui: str | Path | None = None,
    models: str | Path | None = None,
    overrides: list[str] = (),
    report_json: str | Path | None = None,
    out_dir: str | Path | None = None,
    vram_cap: int | None = None,
) -> WorkflowOutcome:
    workflow = load_workflow(workflow_path)
    host = boot(comfyui if comfyui is not None else os.environ.get("COMFYUI_PATH"), vram_cap)
    if models is not None:
        host.add_models_folder(Path(models))
    if out_dir is not None:
        host.set_output_folder(Path(out_dir))
    outcome = host.execute(host.prompt_from(workflow, overrides))
    if host.vram_cap is not None and outcome.report is not None:
        # The report node cannot know the process was capped: the note goes into its report and JSON.
        outcome.report.notes.append(host.vram_cap.note())
        outcome.report.save_json(outcome.report_path)
    if report_json is not None:
        if outcome.report_path is None:
            raise UserError(f"--report-json: {workflow_path} has no {REPORT_NODE} node, so there is no report to copy")
        report_json = Path(report_json)
        report_json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(outcome.report_path, report_json)
        outcome.report_path = report_json
    return outcome
