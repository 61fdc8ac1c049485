"""The pack's source as a whole: pyflakes finds no unused import, undefined name or dead assignment."""
import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

REPO = Path(__file__).resolve().parents[2]


def test_pyflakes_finds_nothing():
    # Hidden folders hold ComfyUI, its venv and the GPU bundle: not the pack's code.
    source = [str(path) for path in sorted(REPO.iterdir())
              if not path.name.startswith(".") and (path.is_dir() or path.suffix == ".py")]
    warnings, errors = io.StringIO(), io.StringIO()
    count = checkRecursive(source, Reporter(warnings, errors))
    assert count == 0, warnings.getvalue() + errors.getvalue()
