"""One measurement in a fresh Python process, for the benches whose figures an earlier run in the same
process would change: peak RSS (``bench vae``, ``plan --check``) and cold compile time
(``bench speed --isolate``).

The parent runs ``python -m MODULE SPEC``; the child module ends with ``serve_child(fn)``, which calls
``fn`` on the JSON spec and prints its JSON result as the last line of stdout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable


def run_in_fresh_process(module: str, spec: dict, what: str, *, env: dict[str, str] | None = None,
                         show_progress: bool = False):
    """``module``'s ``serve_child`` result for ``spec``, from a fresh interpreter with ``env`` added to this
    one's environment. ``show_progress`` passes the child's stderr (its progress bars and logs) through
    instead of keeping it for the error. ``what`` names the measurement in the error when the child fails."""
    done = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], stdout=subprocess.PIPE,
                          stderr=None if show_progress else subprocess.PIPE, text=True,
                          env={**os.environ, **env} if env else None)
    if done.returncode != 0:
        detail = f":\n{done.stderr[-4000:]}" if done.stderr else " (its output is above)"
        raise RuntimeError(f"{what} failed (exit {done.returncode}){detail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve_child(fn: Callable[[dict], object]) -> None:
    """The child's side: ``fn`` of the spec in ``sys.argv[1]``, printed as JSON on the last line."""
    print(json.dumps(fn(json.loads(sys.argv[1]))))
