"""Headless runner: boot ComfyUI in this process with sdopt loaded, run a workflow, collect the report.

``python -m sdopt run`` calls ``run_workflow``; the host test tier uses ``boot`` and
``ComfyHost`` directly. ComfyUI is imported from the given folder (never vendored),
with ``--cpu`` when CUDA is absent, its core nodes, and this pack loaded through
ComfyUI's own ``load_custom_node``, exactly as a ``custom_nodes`` install would be.
The runner stands in for ComfyUI's server: it receives the report node's ``sdopt.report``
event, as the browser does, and never builds or writes a report of its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import inspect
import logging
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..measure.report import Report
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
            from ..nodes.glue import install_node_timer

            install_node_timer(data["prompt_id"])

    def send_progress_text(self, text, node_id, sid=None):
        pass

    def queue_updated(self):
        pass

    def reports(self) -> list[dict]:
        return [data for event, data in self.events if event == REPORT_EVENT]


@contextlib.contextmanager
def _quiet_logging():
    """ComfyUI logs validation problems itself; the runner reports them as one line instead."""
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


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

    def __init__(self, path: Path):
        self.path = path
        argv = sys.argv
        sys.path.insert(0, str(path))
        import torch

        sys.argv = ["main.py"] + ([] if torch.cuda.is_available() else ["--cpu"])
        try:
            import comfy.options

            comfy.options.enable_args_parsing()
            # Before nodes, as in main.py: importing nodes puts comfy/ on sys.path, whose utils.py hides ComfyUI's utils/.
            import utils  # noqa: F401

            import execution
            import folder_paths
            import nodes
            import server
        finally:
            sys.argv = argv
        self._execution, self._folder_paths, self._nodes = execution, folder_paths, nodes
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

    @property
    def node_classes(self) -> dict:
        return self._nodes.NODE_CLASS_MAPPINGS

    def pack(self, name: str):
        """Module ``name`` (e.g. ``"nodes.glue"``) of the pack as ComfyUI loaded it: ComfyUI imports the
        pack under a module name of its own, so that copy holds the state the nodes use."""
        package = self.node_classes[REPORT_NODE].__module__.rsplit(".nodes.", 1)[0]
        return importlib.import_module(f"{package}.{name}")

    def clear_cache(self) -> None:
        """Forget cached node outputs, so the next prompt runs every node."""
        self._executor.reset()

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
                return (
                    f"node {data['node_id']} ({data['node_type']}) failed: "
                    f"{data['exception_type']}: {data['exception_message'].strip()}"
                )
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


def boot(comfyui: str | Path | None) -> ComfyHost:
    """The process's ComfyUI host, booted on first use; one ComfyUI per process."""
    global _host
    path = _check_comfyui(Path(comfyui) if comfyui else None)
    if _host is None:
        _host = ComfyHost(path)
    elif _host.path != path:
        raise UserError(f"ComfyUI from {_host.path} is already loaded in this process; cannot switch to {path}")
    return _host


def run_workflow(
    workflow_path: str | Path,
    comfyui: str | Path | None = None,
    models: str | Path | None = None,
    overrides: list[str] = (),
    report_json: str | Path | None = None,
    out_dir: str | Path | None = None,
) -> WorkflowOutcome:
    workflow = load_workflow(workflow_path)
    host = boot(comfyui if comfyui is not None else os.environ.get("COMFYUI_PATH"))
    if models is not None:
        host.add_models_folder(Path(models))
    if out_dir is not None:
        host.set_output_folder(Path(out_dir))
    outcome = host.execute(host.prompt_from(workflow, overrides))
    if report_json is not None:
        if outcome.report_path is None:
            raise UserError(f"--report-json: {workflow_path} has no {REPORT_NODE} node, so there is no report to copy")
        report_json = Path(report_json)
        report_json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(outcome.report_path, report_json)
        outcome.report_path = report_json
    return outcome
