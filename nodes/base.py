"""The skeleton every sdopt node shares, on ComfyUI's V1 node interface: its category, the function
ComfyUI calls, and that function's values checked against ``INPUT_TYPES`` before it runs (from the
function's own signature, so a call from Python is held to the same promise as a prompt).
``PatchNode`` adds the MODEL or VAE input it patches and returns; ``SavingNode`` is an output node that saves
under a ``filename_prefix`` and re-runs on every queue."""
from __future__ import annotations

import functools
import inspect

from .inputs import check_inputs, patched_input

CATEGORY = "sdopt"


def _checked(method):
    """``method`` with its widget values (the ``required`` and ``optional`` inputs) checked first."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        declared = {name for section in ("required", "optional") for name in type(self).INPUT_TYPES().get(section, {})}
        check_inputs(type(self), **{name: value for name, value in bound.arguments.items() if name in declared})
        return method(self, *args, **kwargs)

    return run


class SDOptNode:
    """An sdopt node: a subclass defines ``INPUT_TYPES`` and the method ``FUNCTION`` names."""

    CATEGORY = CATEGORY
    FUNCTION = "patch"
    RETURN_TYPES: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get(cls.FUNCTION)
        if method is not None:
            setattr(cls, cls.FUNCTION, _checked(method))

    @classmethod
    def optional_inputs(cls) -> dict:
        return {}


class PatchNode(SDOptNode):
    """A node that takes a MODEL or VAE (``PATCHES``) and returns a patched copy; the input it was given
    is never changed. A subclass lists its other inputs in ``inputs()`` (and ``optional_inputs()``)."""

    PATCHES = "MODEL"
    # The patched input's tooltip, where the node does not patch but watches (the profiler)
    SUBJECT_TOOLTIP: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.RETURN_TYPES = (cls.PATCHES,)

    @classmethod
    def inputs(cls) -> dict:
        return {}

    @classmethod
    def INPUT_TYPES(cls):
        subject = (cls.PATCHES, {"tooltip": cls.SUBJECT_TOOLTIP}) if cls.SUBJECT_TOOLTIP else patched_input(cls.PATCHES)
        types = {"required": {cls.PATCHES.lower(): subject, **cls.inputs()}}
        optional = cls.optional_inputs()
        return {**types, "optional": optional} if optional else types


class SavingNode(SDOptNode):
    """An output node that saves a file under ``filename_prefix`` in ComfyUI's output folder and re-runs on
    every queue (what it shows is of this prompt or this machine now, never a cached answer)."""

    OUTPUT_NODE = True
    PREFIX_DEFAULT = "sdopt/out"
    PREFIX_TOOLTIP = "Where the file is saved, under the output folder."
    HIDDEN = {"unique_id": "UNIQUE_ID"}

    @classmethod
    def INPUT_TYPES(cls):
        required = {"filename_prefix": ("STRING", {"default": cls.PREFIX_DEFAULT, "tooltip": cls.PREFIX_TOOLTIP})}
        optional = cls.optional_inputs()
        return {"required": required, **({"optional": optional} if optional else {}), "hidden": dict(cls.HIDDEN)}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")
