"""The pack's source as a whole: pyflakes finds no unused import, undefined name or dead assignment; no
import circles among the pack's modules, and every import runs downward through ``LAYERS``; no module over
``MAX_MODULE_LINES`` lines."""
import ast
import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 600
# The pack's packages, lowest first: a module imports from its own package or one below it.
LAYERS = ("errors", "families", "optim", "measure", "nodes", "tools")


def _pack_sources() -> list[Path]:
    # Hidden folders hold ComfyUI, its venv and the GPU bundle: not the pack's code.
    return [path for path in sorted(REPO.iterdir())
            if not path.name.startswith(".") and (path.is_dir() or path.suffix == ".py")]


def _modules() -> dict[str, Path]:
    """Dotted name (relative to the pack's root) of every module of the pack outside tests."""
    found = {}
    for top in _pack_sources():
        if top.name == "tests":
            continue
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pack's modules that ``name`` imports (relative imports, function-local ones too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
        target = ".".join([*base, *(node.module.split(".") if node.module else [])])
        for alias in node.names:
            child = f"{target}.{alias.name}" if target else alias.name
            found.add(child if child in modules else target)
    return {module for module in found if module in modules and module != name}


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a longer loop (Tarjan's strongly
    connected components of more than one module)."""
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for child in graph[name]:
            if child not in index:
                visit(child)
                low[name] = min(low[name], low[child])
            elif child in on_stack:
                low[name] = min(low[name], index[child])
        if low[name] == index[name]:
            group = []
            while not group or group[-1] != name:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return circles


def test_pyflakes_finds_nothing():
    warnings, errors = io.StringIO(), io.StringIO()
    count = checkRecursive([str(path) for path in _pack_sources()], Reporter(warnings, errors))
    assert count == 0, warnings.getvalue() + errors.getvalue()


def test_no_import_circles():
    assert import_circles(_modules()) == []


def test_imports_run_downward():
    modules = _modules()
    upward = [f"{name} imports {imported}" for name, path in modules.items() if name.split(".")[0] in LAYERS
              for imported in sorted(_imports(name, path, modules))
              if imported.split(".")[0] in LAYERS and LAYERS.index(imported.split(".")[0]) > LAYERS.index(name.split(".")[0])]
    assert upward == []


def test_the_circle_check_sees_a_circle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    modules = {name: tmp_path / f"{name}.py" for name in "abc"}
    assert import_circles(modules) == [["a", "b"]]


def test_no_module_over_the_line_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these by subject (at most {MAX_MODULE_LINES} lines each)"
