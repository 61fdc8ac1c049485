"""The one exception type that the CLI prints as a single line, without a traceback."""


class UserError(Exception):
    """A problem with the user's input: the message names the input and the fix."""

    # ComfyUI loads the pack under its folder path; this keeps its error dialog reading "sdopt.UserError".
    __module__ = "sdopt"
