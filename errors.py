"""The one exception type that the CLI prints as a single line, without a traceback."""


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""
