"""Progress bars for the CLI: tqdm's bar on a terminal, plain lines in a log.

Off a terminal (a file, a pipe, a CI log) tqdm still redraws its bar with carriage returns and,
for nested or closed bars, cursor-up codes (``\\x1b[A``), which a log keeps as dozens of partial
lines. ``progress_bar`` takes tqdm's arguments and, where its output is not a TTY, writes one plain
line per finished item instead: ``desc: 3/8 runs, 12.4 s (postfix)``; past ``EVERY_ITEM_UP_TO`` items
(a checkpoint's 730 tensors), one line per twentieth of the total and the last.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit}, {elapsed_s:.1f} s{postfix}"
EVERY_ITEM_UP_TO = 40
_STEPS = 20


class LogLines(tqdm):
    """tqdm that prints a line, with no cursor codes, each time the count moves; nothing else."""

    def __init__(self, *args, **kwargs):
        kwargs.update(mininterval=0, miniters=1, dynamic_ncols=False, ncols=None, position=None, ascii=True)
        kwargs.setdefault("bar_format", LOG_FORMAT)
        self._shown = 0
        super().__init__(*args, **kwargs)

    def _due(self) -> bool:
        """Progress worth a line: any, up to ``EVERY_ITEM_UP_TO`` items (or an unknown total); past
        that, a new twentieth of the total, or the end."""
        if self.n == self._shown:  # a refresh without progress (a new postfix, the bar's start or close)
            return False
        total = self.total
        if total is None or total <= EVERY_ITEM_UP_TO or self.n >= total:
            return True
        return self.n * _STEPS // total > self._shown * _STEPS // total

    def display(self, msg=None, pos=None):
        if not self._due():
            return True
        self._shown = self.n
        total = self.total if self.total is not None else "?"
        postfix = f" ({self.postfix.lstrip(', ')})" if self.postfix else ""
        line = LOG_FORMAT.format(desc=self.desc.rstrip(": ") or "progress", n_fmt=self.n, total_fmt=total,
                                 unit=self.unit + ("s" if self.unit and not self.unit.endswith("s") else ""),
                                 elapsed_s=self.format_dict["elapsed"], postfix=postfix)
        self.fp.write(line + "\n")
        self.fp.flush()
        return True

    def clear(self, nolock=False):
        """Nothing to clear: lines are never redrawn (``tqdm.write`` calls this around its message)."""

    def moveto(self, n):
        """No cursor to move."""

    def close(self):
        if self.disable:
            return super().close()
        self.display()  # the last count, where no refresh showed it (an unknown or unreached total)
        self.disable = True  # what tqdm writes on closing (a newline, a carriage return) is for a terminal
        self._decr_instances(self)


def progress_bar(*args, **kwargs) -> tqdm:
    """``tqdm(*args, **kwargs)`` on a terminal; ``LogLines`` where the output (``file``, default
    stderr) is not one."""
    stream = kwargs.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return tqdm(*args, **kwargs) if isatty is not None and isatty() else LogLines(*args, **kwargs)
