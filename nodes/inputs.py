"""What a node's ``INPUT_TYPES`` promises, and its values held to it: the input a node patches (with the
tooltip that promises a copy), the ``on_unavailable`` input, ``check_inputs`` (each bad value named under its
own input) and ``output_file_base`` (a ``filename_prefix`` kept inside ComfyUI's output folder)."""
from __future__ import annotations

import os

from ..errors import UserError

DEFAULT = "default"


PATCHED_SUBJECTS = {"MODEL": "diffusion model", "VAE": "VAE"}


def patched_input(kind: str) -> tuple[str, dict]:
    """The input a patching node takes its MODEL or VAE from, with the tooltip that promises a copy."""
    return (kind, {"tooltip": f"The {PATCHED_SUBJECTS[kind]} to patch; it is never changed, the node returns a patched copy."})

ON_UNAVAILABLE = ("fallback", "error")


def on_unavailable_input(tooltip: str) -> tuple[list[str], dict]:
    """The ``on_unavailable`` input: fall back (with the reason in the record) or stop with an error."""
    return list(ON_UNAVAILABLE), {"default": "fallback", "tooltip": tooltip}

def _input_problem(kind, options: dict, value) -> str | None:
    if isinstance(kind, (list, tuple)):
        return None if value in kind else f"{value!r} is not offered (choose one of {', '.join(map(str, kind))})"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not true or false"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not text"
    if kind not in ("INT", "FLOAT"):
        return None  # a MODEL, VAE, LATENT...: ComfyUI checks the link's type
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "INT" and not whole:
        return f"{value!r} is not a whole number"
    if not (whole or isinstance(value, float)) or value != value:  # NaN is not a number either
        return f"{value!r} is not a number"
    if "min" in options and value < options["min"]:
        return f"{value} is below its minimum (give {options['min']} or more)"
    if "max" in options and value > options["max"]:
        return f"{value} is above its maximum (give {options['max']} or less)"
    return None


def output_file_base(filename_prefix: str) -> tuple[str, str, int, str]:
    """(folder, name, counter, subfolder) of the next file a node saves under ``filename_prefix`` in
    ComfyUI's output folder. A prefix that leaves that folder is ``filename_prefix``'s error, raised
    before ComfyUI's own check would log its refusal and raise a bare Exception."""
    import folder_paths

    output = os.path.abspath(folder_paths.get_output_directory())
    folder = os.path.abspath(os.path.join(output, os.path.dirname(os.path.normpath(filename_prefix))))
    if os.path.commonpath((output, folder)) != output:
        raise UserError(f"filename_prefix: {filename_prefix!r} leaves ComfyUI's output folder; give a path inside it, "
                        "e.g. sdopt/profile")
    return folder_paths.get_save_image_path(filename_prefix, output)[:4]


def check_inputs(node_class, **values) -> None:
    """A ``UserError`` with one message per input, each naming its own input, for every value that
    ``node_class.INPUT_TYPES()`` does not take: not among its options, of another type, or past an
    INT's or FLOAT's min or max. ComfyUI checks widget values so before a prompt runs, but not
    linked values, nor calls from Python."""
    spec = {name: entry for section in node_class.INPUT_TYPES().values() for name, entry in section.items()}
    problems = []
    for name, value in values.items():
        kind, options = spec[name][0], (spec[name][1] if len(spec[name]) > 1 else {})
        problem = _input_problem(kind, options, value)
        if problem:
            problems.append(f"{name}: {problem}")
    if problems:
        raise UserError("; ".join(problems))
