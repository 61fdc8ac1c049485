"""The pages ComfyUI shows in its node documentation panel (``web/docs/<NodeClass>.md``), and the length of
what a user reads first: every registered node has its page, a page's ``## Inputs`` section names exactly the
node's inputs (one ``- **`name`**: ...`` bullet each), the README stays within 1,500 words, a node's
DESCRIPTION within 40 and an input's tooltip within 25.

The page readers here are shared: ``tests/host/test_documented_fallbacks.py`` reads each page's promises
through ``page_paragraphs``."""
import re
from pathlib import Path

import pytest

from sdopt.nodes import registry

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "web" / "docs"
README_WORDS = 1500
DESCRIPTION_WORDS = 40
TOOLTIP_WORDS = 25
INPUT_BULLET = re.compile(r"^- \*\*`(\w+)`\*\*:", re.M)
LIST_ITEM = re.compile(r"^\s*- ")


def page_path(node: str) -> Path:
    return DOCS / f"{node}.md"


def section(text: str, title: str) -> str:
    """The body of ``## title`` up to the next heading of that level ("" where there is none)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1) if match else ""


def documented_inputs(text: str) -> list[str]:
    """The input names the page's Inputs section gives, in its order."""
    return INPUT_BULLET.findall(section(text, "Inputs"))


def node_inputs(cls) -> list[str]:
    """The inputs a user wires or sets: ``required`` and ``optional`` (never ComfyUI's ``hidden`` ones)."""
    types = cls.INPUT_TYPES()
    return [name for part in ("required", "optional") for name in types.get(part, {})]


def input_problems(documented: list[str], inputs: list[str]) -> list[str]:
    problems = [f"names `{name}`, which the node does not have" for name in documented if name not in inputs]
    problems += [f"leaves out `{name}`" for name in inputs if name not in documented]
    return problems + [f"names `{name}` twice" for name in sorted(set(documented)) if documented.count(name) > 1]


def page_paragraphs(text: str) -> list[str]:
    """The page's prose, one string per paragraph or list item (its wrapped lines joined, the bullet
    dropped); headings and code blocks left out."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("#") or not line.strip() or LIST_ITEM.match(line):
            if current:
                blocks.append(" ".join(current))
            current = [LIST_ITEM.sub("", line, count=1).strip()] if LIST_ITEM.match(line) and not fenced else []
            continue
        current.append(line.strip())
    return blocks + ([" ".join(current)] if current else [])


def words(text: str) -> int:
    return len(text.split())


NODES = sorted(registry.NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node", NODES)
def test_a_registered_node_has_its_page(node):
    assert page_path(node).is_file(), f"{node} has no page: write web/docs/{node}.md (what it does, ## Inputs, " \
                                      "what it measured, its limits, how it composes)"


@pytest.mark.parametrize("node", NODES)
def test_a_page_names_exactly_the_nodes_inputs(node):
    page = page_path(node)
    if not page.is_file():
        pytest.fail(f"web/docs/{node}.md is missing")
    problems = input_problems(documented_inputs(page.read_text()), node_inputs(registry.NODE_CLASS_MAPPINGS[node]))
    assert not problems, f"web/docs/{node}.md, ## Inputs: " + "; ".join(problems)


def test_every_page_is_a_registered_nodes():
    assert sorted(path.stem for path in DOCS.glob("*.md") if path.stem not in registry.NODE_CLASS_MAPPINGS) == []


def test_the_readme_stays_within_its_words():
    assert words((REPO / "README.md").read_text()) <= README_WORDS, "move the detail to the node pages or docs/"


@pytest.mark.parametrize("node", NODES)
def test_a_description_stays_within_its_words(node):
    description = getattr(registry.NODE_CLASS_MAPPINGS[node], "DESCRIPTION", "")
    assert description, f"{node} has no DESCRIPTION"
    assert words(description) <= DESCRIPTION_WORDS, f"{node}'s DESCRIPTION has {words(description)} words"


@pytest.mark.parametrize("node", NODES)
def test_a_tooltip_stays_within_its_words(node):
    types = registry.NODE_CLASS_MAPPINGS[node].INPUT_TYPES()
    long = {name: words(spec[1]["tooltip"]) for part in ("required", "optional") for name, spec in types.get(part, {}).items()
            if len(spec) > 1 and words(spec[1].get("tooltip", "")) > TOOLTIP_WORDS}
    assert not long, f"{node}: tooltips over {TOOLTIP_WORDS} words: {long}"


def test_the_checks_see_a_wrong_inputs_section_and_long_words():
    page = "# x\n\n## Inputs\n\n- **`model`**: the model.\n  - `a`: nested, not an input.\n- **`gone`**: no longer there.\n\n## Limits\n\n- **`mode`**: not in Inputs.\n"
    assert documented_inputs(page) == ["model", "gone"]
    assert input_problems(documented_inputs(page), ["model", "mode"]) == [
        "names `gone`, which the node does not have", "leaves out `mode`"]
    assert input_problems(["model", "model"], ["model"]) == ["names `model` twice"]
    assert words("one two  three\nfour") == 4


def test_page_paragraphs_joins_wrapped_lines_and_keeps_list_items_apart():
    page = "# Title\n\nFirst line\nwrapped.\n\n- **`x`**: one\n  wrapped.\n  - nested item.\n\n```\ncode line\n```\nAfter."
    assert page_paragraphs(page) == ["First line wrapped.", "**`x`**: one wrapped.", "nested item.", "After."]
