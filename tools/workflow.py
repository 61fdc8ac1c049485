"""Workflow files: read UI or API format, convert UI to API with node definitions, apply --set.

Pure Python, no ComfyUI import: node definitions come in ComfyUI's ``/object_info``
shape (``{class_type: {"input": {"required": {...}, "optional": {...}}}}``), which the
headless runner builds from the live node classes and the unit tests from fixtures.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..families import MODEL_NAMES, model_name_of_file

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
# Frontend-only nodes: they never reach the server.
NOTE_TYPES = {"Note", "MarkdownNote"}
REROUTE_TYPE = "Reroute"
PRIMITIVE_TYPE = "PrimitiveNode"
BOOLEAN_TEXT = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
MODE_MUTED = 2
MODE_BYPASSED = 4
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Text chunks of a PNG saved by ComfyUI, in the order they are read: the UI workflow keeps titles and muted nodes.
PNG_WORKFLOW_CHUNKS = ("workflow", "prompt")
_UNCONNECTED = object()


def load_workflow(path: str | Path) -> dict:
    """Read a workflow file, JSON or a PNG saved by ComfyUI; bad paths and contents raise a one-line ``UserError``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"workflow file {path} does not exist: check the path")
    content = path.read_bytes()
    json_source = str(path)
    if content.startswith(PNG_SIGNATURE):
        chunk, content = _png_workflow_text(path)
        json_source = f'{path} (its "{chunk}" text chunk)'
    try:
        # From bytes, json reads UTF-8 with or without the BOM that Windows editors write, and PowerShell's UTF-16.
        data = json.loads(content)
    except UnicodeDecodeError:
        raise UserError(
            f"{path} is neither a JSON workflow nor a PNG saved by ComfyUI: export the workflow from ComfyUI "
            "(Workflow > Export, or Export (API)) and run that file"
        ) from None
    except json.JSONDecodeError as error:
        raise UserError(
            f"{json_source} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}): "
            "export the workflow again from ComfyUI"
        ) from None
    if not isinstance(data, dict) or not (is_ui_format(data) or is_api_format(data)):
        raise UserError(f"{path} is neither a ComfyUI UI workflow nor an API prompt: export it again from ComfyUI")
    if is_api_format(data):
        _check_api_links(data)
    return data


def _png_workflow_text(path: Path) -> tuple[str, str]:
    """(chunk name, text) of the workflow that ComfyUI embeds in a PNG: the UI workflow, else the API prompt."""
    from PIL import Image  # Pillow comes with ComfyUI; only PNG workflows need it

    try:
        with Image.open(path) as image:
            chunks = image.text  # every text chunk, also those after the image data
    except (OSError, SyntaxError) as error:
        raise UserError(f"{path} is a PNG that cannot be read ({error}): save the image from ComfyUI again") from None
    for name in PNG_WORKFLOW_CHUNKS:
        if name in chunks:
            return name, chunks[name]
    raise UserError(
        f'{path} is a PNG without a ComfyUI workflow (no "workflow" or "prompt" text chunk; sites that re-encode '
        "images drop it): use the PNG as ComfyUI's Save Image wrote it, or export the workflow as JSON from ComfyUI"
    )


def _check_api_links(prompt: dict) -> None:
    """A link to a node the prompt lacks, or inputs that are not an object, is a ``UserError`` naming the node
    and input; ComfyUI's error names only the node, or is a traceback."""
    for node_id, node in prompt.items():
        inputs = node.get("inputs") or {}
        if not isinstance(inputs, dict):
            raise UserError(
                f"node {node_id} ({node['class_type']}) has inputs of type {type(inputs).__name__}, where ComfyUI's "
                'API format has an object of name: value: export the prompt again with "Export (API)"'
            )
        for name, value in inputs.items():
            # ComfyUI's shape of a link: [source node id, output slot], node ids being strings.
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] not in prompt:
                raise UserError(
                    f"node {node_id} ({node['class_type']}) input {name} links to node {value[0]}, which is not in "
                    "the workflow: connect the input to an existing node in ComfyUI and export the prompt again"
                )


def is_ui_format(data: dict) -> bool:
    return isinstance(data.get("nodes"), list) and isinstance(data.get("links"), list)


def is_api_format(data: dict) -> bool:
    return bool(data) and all(isinstance(node, dict) and "class_type" in node for node in data.values())


def _spec_parts(spec) -> tuple:
    """(type, options) of an input spec such as ``("INT", {"default": 20})``."""
    kind = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    options = spec[1] if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
    return kind, options


def _takes_value(spec) -> bool:
    """Whether an input spec takes a value (a widget's type) rather than only a link from another node's output."""
    kind, _options = _spec_parts(spec)
    return isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES


def _is_widget(spec) -> bool:
    """Whether an input spec is drawn as a widget (and so has a slot in widgets_values)."""
    return not _spec_parts(spec)[1].get("forceInput") and _takes_value(spec)


def widget_names(definition: dict) -> list[str]:
    inputs = definition.get("input", {})
    specs = {**inputs.get("required", {}), **inputs.get("optional", {})}
    order = definition.get("input_order")
    names = (order.get("required", []) + order.get("optional", [])) if order else list(specs)
    return [name for name in names if name in specs and _is_widget(specs[name])]


def _widget_inputs(node: dict, definition: dict) -> dict:
    values = node.get("widgets_values") or []
    if isinstance(values, dict):
        return {name: values[name] for name in widget_names(definition) if name in values}
    inputs, position = {}, 0
    for name in widget_names(definition):
        if position >= len(values):
            break
        inputs[name] = values[position]
        position += 1
        # Seed widgets carry a hidden "control after generate" value right after them.
        if position < len(values) and isinstance(values[position], str) and values[position] in SEED_CONTROL_VALUES:
            position += 1
    return inputs


@dataclass(frozen=True)
class _Link:
    source: int
    slot: int
    type: str


def _nodes_by_id(workflow: dict) -> dict:
    nodes = {}
    for position, node in enumerate(workflow["nodes"], start=1):
        if not isinstance(node, dict) or "id" not in node:
            raise UserError(f"entry {position} of the workflow's nodes has no id: export the workflow again from ComfyUI")
        if "type" not in node:
            raise UserError(
                f'node {node["id"]} has no "type" (its node class, such as "KSampler"): add it or delete the node'
            )
        nodes[node["id"]] = node
    return nodes


def _links_by_id(workflow: dict) -> dict:
    links = {}
    for position, entry in enumerate(workflow["links"], start=1):
        if isinstance(entry, dict) and {"id", "origin_id", "origin_slot", "type"} <= entry.keys():
            links[entry["id"]] = _Link(entry["origin_id"], entry["origin_slot"], entry["type"])
        elif isinstance(entry, list) and len(entry) >= 6:
            link_id, source, slot, _target, _target_slot, link_type = entry[:6]
            links[link_id] = _Link(source, slot, link_type)
        else:
            raise UserError(
                f"entry {position} of the workflow's links is not [id, origin node, origin slot, target node, "
                "target slot, type]: export the workflow again from ComfyUI"
            )
    return links


def ui_to_api(workflow: dict, definitions: dict) -> dict:
    """Convert a UI-format workflow to an API prompt, as the ComfyUI frontend does on queue."""
    nodes = _nodes_by_id(workflow)
    links = _links_by_id(workflow)

    unknown = sorted(
        {
            node["type"]
            for node in nodes.values()
            if node["type"] not in definitions and node["type"] not in NOTE_TYPES | {REROUTE_TYPE, PRIMITIVE_TYPE}
        }
    )
    if unknown:
        raise UserError(unknown_types_message(unknown))

    def resolve(link_id: int, target_id: int):
        """Follow reroutes and bypassed nodes back to a real output ``[id, slot]``, or a primitive's value."""
        if link_id not in links:
            raise UserError(
                f"node {target_id} ({nodes[target_id]['type']}) is connected by link {link_id}, which is not in "
                "the workflow's links: reconnect the node's inputs in ComfyUI and save again"
            )
        link = links[link_id]
        if link.source not in nodes:
            raise UserError(
                f"link {link_id} comes from node {link.source}, which is not in the workflow: "
                "reconnect or delete the link in ComfyUI and save again"
            )
        source = nodes[link.source]
        if source["type"] == REROUTE_TYPE:
            upstream = (source.get("inputs") or [{}])[0].get("link")
            return resolve(upstream, link.source) if upstream is not None else _UNCONNECTED
        if source["type"] == PRIMITIVE_TYPE:
            return (source.get("widgets_values") or [None])[0]
        if source.get("mode") == MODE_BYPASSED:
            for entry in source.get("inputs", []):
                if entry.get("link") is not None and entry.get("type") == link.type:
                    return resolve(entry["link"], link.source)
            return _UNCONNECTED
        if source.get("mode") == MODE_MUTED:
            return _UNCONNECTED
        return [str(link.source), link.slot]

    prompt = {}
    for node_id, node in nodes.items():
        if node["type"] not in definitions or node.get("mode") in (MODE_MUTED, MODE_BYPASSED):
            continue
        inputs = _widget_inputs(node, definitions[node["type"]])
        for entry in node.get("inputs", []):
            if entry.get("link") is None:
                continue
            value = resolve(entry["link"], node_id)
            if value is not _UNCONNECTED:
                inputs[entry["name"]] = value
        api_node = {"class_type": node["type"], "inputs": inputs}
        if node.get("title"):
            api_node["_meta"] = {"title": node["title"]}
        prompt[str(node_id)] = api_node
    return prompt


def unknown_types_message(types: list[str]) -> str:
    listed = ", ".join(types)
    return (
        f"unknown node type{'s' if len(types) > 1 else ''} {listed}: install the custom node pack that "
        "provides it into ComfyUI (the runner loads ComfyUI's core nodes and sdopt only)"
    )


def parse_override(text: str) -> tuple[str, str, object]:
    """Split ``TARGET.INPUT=VALUE``; VALUE is read as JSON when it parses, else kept as text."""
    target_input, sep, raw = text.partition("=")
    target, dot, name = target_input.rpartition(".")
    if not sep or not dot or not target or not name:
        raise UserError(f"--set {text!r} is not CLASS_OR_TITLE.INPUT=VALUE: write e.g. --set KSampler.steps=2")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return target, name, value


def apply_overrides(prompt: dict, overrides: list[str], definitions: dict) -> dict:
    """Set inputs on every node whose class or title matches; unmatched overrides raise ``UserError``."""
    for text in overrides:
        target, name, value = parse_override(text)
        matched = [
            node
            for node in prompt.values()
            if node["class_type"] == target or node.get("_meta", {}).get("title") == target
        ]
        if not matched:
            raise UserError(
                f"--set {text!r} matches no node: no node has class or title {target!r} "
                f"(classes here: {', '.join(sorted({n['class_type'] for n in prompt.values()}))})"
            )
        for node in matched:
            definition = definitions.get(node["class_type"], {}).get("input", {})
            known = {**definition.get("required", {}), **definition.get("optional", {})}
            if name not in known:
                raise UserError(
                    f"--set {text!r}: {node['class_type']} has no input {name!r} "
                    f"(its inputs: {', '.join(known) or 'none'})"
                )
            if not _takes_value(known[name]):
                widgets = ", ".join(input_name for input_name, spec in known.items() if _takes_value(spec))
                raise UserError(
                    f"--set {target}.{name}: {name} is a link ({_spec_parts(known[name])[0]}), not a widget; "
                    f"--set takes widget inputs ({node['class_type']}'s: {widgets or 'none'})"
                )
            node["inputs"][name] = typed_value(f"{target}.{name}", known[name], value, text.partition("=")[2])
    return prompt


def typed_value(setting: str, spec, value, raw: str):
    """``value`` (``raw`` read as JSON, else the text itself) as the input ``spec`` takes it.

    ComfyUI converts widget values with ``bool()`` and ``int()``, so ``False`` given as text would run
    as True and 2.7 steps as 2. A BOOLEAN input takes true/false, 1/0, yes/no or on/off (any case), an
    INT a whole number, a FLOAT a finite number; anything else is a ``UserError`` naming ``--set setting``.
    A STRING input takes the text as written (``true`` stays the word, not JSON's boolean).
    """
    kind, options = _spec_parts(spec)
    if kind == "STRING":
        return raw
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "BOOLEAN":
        if str(value).lower() not in BOOLEAN_TEXT:
            raise UserError(f"--set {setting}: {raw!r} is not a boolean: write true or false (or 1/0, yes/no, on/off)")
        return BOOLEAN_TEXT[str(value).lower()]
    if kind == "INT":
        if not number or value != int(value):
            raise UserError(f"--set {setting}: {raw!r} is not a whole number: write e.g. --set {setting}={options.get('default', 1)}")
        return int(value)
    if kind == "FLOAT":
        if not number:
            raise UserError(f"--set {setting}: {raw!r} is not a number: write e.g. --set {setting}={options.get('default', 1.0)}")
        return float(value)
    return value


def validation_message(node_id: str, class_type: str, reason: dict, checkpoint_folders: list[str]) -> str:
    """One line for a ComfyUI validation error; a missing checkpoint gets the make-model fix."""
    info = reason.get("extra_info", {})
    name, value = info.get("input_name", ""), info.get("received_value")
    if reason["type"] == "value_not_in_list" and name == "ckpt_name":
        target = Path(checkpoint_folders[0]) / str(value) if checkpoint_folders else value
        model = model_name_of_file(Path(str(value)).name)
        create = (
            f"create it with `python -m sdopt make-model {model} --out {target}`" if model else
            f"a generated checkpoint is made with `python -m sdopt make-model NAME --out {target}` "
            f"(NAME: {', '.join(MODEL_NAMES)})"
        )
        return (
            f"missing model file {value!r} (node {node_id} {class_type}.{name}): it is not in "
            f"{', '.join(checkpoint_folders) or 'any checkpoints folder'}; {create} or point --models at the folder that has it"
        )
    where = f"node {node_id} {class_type}" + (f".{name}" if name else "")
    return f"{where}: {reason['message']}: {reason['details']}".rstrip(": ")
