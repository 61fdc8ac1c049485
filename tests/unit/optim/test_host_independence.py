"""optim/ as a whole stays host-independent (its ``__init__``'s rule): no module imports a host, the
profiler or the report."""
import ast
from pathlib import Path

import sdopt.optim

OPTIM = Path(sdopt.optim.__file__).resolve().parent
FORBIDDEN_TOP = ("measure", "nodes", "tools", "server", "folder_paths", "execution", "main")


def _forbidden(module: str) -> bool:
    top = module.split(".")[0]
    return top.startswith("comfy") or top in FORBIDDEN_TOP or module.startswith(("sdopt.measure", "sdopt.nodes", "sdopt.tools"))


def _imports(tree: ast.AST):
    """(line, module name as it resolves from optim/) of every import, string module names of
    importlib.import_module/__import__ calls included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module
            elif node.level == 1:  # a sibling in optim/
                yield node.lineno, "sdopt.optim." + (node.module or "")
            else:  # the package root: ..measure, .. import nodes
                names = [node.module] if node.module else [alias.name for alias in node.names]
                yield from ((node.lineno, name) for name in names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def test_the_import_rule_sees_what_it_must_refuse():
    source = (
        "import comfy.model_management\nfrom comfy_execution import progress\nfrom ..measure.profiler import x\n"
        "from .. import nodes\nimport server\ndef f():\n    import folder_paths\n    importlib.import_module('measure.report')\n"
        "from . import precision\nfrom ..errors import UserError\nimport torch\n"
    )
    found = [name for _, name in _imports(ast.parse(source)) if _forbidden(name)]
    assert found == ["comfy.model_management", "comfy_execution", "measure.profiler", "nodes", "server", "folder_paths", "measure.report"]


def test_optim_never_imports_a_host_the_profiler_or_the_report():
    files = sorted(OPTIM.rglob("*.py"))
    # the scan reaches modules at the top and inside packages (attention/, tiled_vae/)
    assert {"attention/__init__.py", "attention/auto.py", "precision.py", "tiled_vae/adapters.py"} <= {
        f.relative_to(OPTIM).as_posix() for f in files}
    offending = [
        f"{path.relative_to(OPTIM)}:{line}: {name}"
        for path in files
        for line, name in _imports(ast.parse(path.read_text(), str(path)))
        if _forbidden(name)
    ]
    assert offending == []
