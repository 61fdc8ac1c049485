"""nodes.registry is the one list of nodes: every registered node has its row in the README's Nodes table,
a place in the example workflows, a host test of its own, and every node is built on the node base."""
import json
import re
from pathlib import Path

import pytest

from sdopt.nodes import registry
from sdopt.nodes.base import PatchNode, SDOptNode

REPO = Path(__file__).resolve().parents[3]
# Examines the machine rather than a workflow's model; the browser tier opens it on its own.
NOT_IN_WORKFLOWS = {"SDOptDoctor"}


def _nodes_table() -> str:
    readme = (REPO / "README.md").read_text()
    return readme[readme.index("## Nodes"):readme.index("\n## ", readme.index("## Nodes") + 1)]


def _workflow_nodes() -> set[str]:
    return {node["type"] for path in (REPO / "workflows").glob("*.json") for node in json.loads(path.read_text())["nodes"]}


def missing(names, have) -> list[str]:
    return sorted(set(names) - set(have))


@pytest.mark.parametrize("node", sorted(registry.NODE_CLASS_MAPPINGS))
def test_a_registered_node_has_its_readme_row_workflow_and_host_test(node):
    cls = registry.NODE_CLASS_MAPPINGS[node]
    title = registry.NODE_DISPLAY_NAME_MAPPINGS[node]
    assert f"**{title}** (`{node}`)" in _nodes_table(), "a row in the README's Nodes table"
    assert node in _workflow_nodes() or node in NOT_IN_WORKFLOWS, "used by an example workflow"
    module = cls.__module__.rsplit(".", 1)[-1]
    assert (REPO / "tests" / "host" / "nodes" / f"test_{module}.py").exists(), "a host test of its own"
    assert issubclass(cls, SDOptNode) and cls.CATEGORY == "sdopt"


def test_the_checks_see_a_node_missing_from_the_readme_and_workflows():
    table, used = _nodes_table(), _workflow_nodes()
    assert missing(["SDOptExported"], re.findall(r"\(`(SDOpt\w+)`\)", table)) == ["SDOptExported"]
    assert missing(["SDOptExported"], used) == ["SDOptExported"]


def test_a_patch_node_returns_what_it_patches_and_takes_it_first():
    for cls in registry.NODE_CLASS_MAPPINGS.values():
        if issubclass(cls, PatchNode):
            required = cls.INPUT_TYPES()["required"]
            assert cls.RETURN_TYPES == (cls.PATCHES,) and next(iter(required)) == cls.PATCHES.lower()
            assert required[cls.PATCHES.lower()][0] == cls.PATCHES
