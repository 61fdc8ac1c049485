"""What the pack tells a user is wrong: ``UserError``, the one exception type that the CLI prints as a
single line without a traceback, and ``Unavailable``, what every technique's ``unavailable(config,
device, ...)`` answers where it cannot run."""
from typing import NamedTuple


class UserError(Exception):
    """A problem with the user's input: the message names the input and the fix."""

    # ComfyUI loads the pack under its folder path; this keeps its error dialog reading "sdopt.UserError".
    __module__ = "sdopt"


class Unavailable(NamedTuple):
    """Why a technique cannot run here, what fixes it, and the node input the fix concerns (a node
    raising the error files it under that input)."""

    reason: str
    fix: str
    input: str = "on_unavailable"
