"""Each sdopt node's page (web/docs/<NodeClass>.md) in ComfyUI's node-docs panel, opened as a user does:
the node placed on the canvas and selected, then the selection toolbox's info button pressed (for the
next node the open panel turns to its page). The panel shows the page rendered from Markdown, not the frontend's fallback (the DESCRIPTION and an inputs table), which is
what a missing or unserved page gives."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

DOCS = Path(__file__).resolve().parents[2] / "web" / "docs"

# Selected through the canvas' API, which tells the frontend's selection store as a click does (a click
# on the title was flaky here: the toolbox is redrawn while the canvas settles).
PLACE_AND_SELECT = """(type) => {
    const graph = app.rootGraph ?? app.graph;
    graph.clear();
    const node = LiteGraph.createNode(type);
    node.pos = [700, 200];  // clear of the docs panel, which opens on the left
    graph.add(node);
    app.canvas.selectItems ? app.canvas.selectItems([node]) : app.canvas.selectNode(node);
    app.canvas.setDirty(true, true);
}"""


def _first_paragraph(page: str) -> str:
    """The page's first sentence of prose, as the panel renders it (Markdown's inline code marks dropped)."""
    body = page.split("\n\n")[1]
    sentence = " ".join(body.split()).split(": ")[0].split(". ")[0]
    return re.sub(r"[`*_]", "", sentence)[:60]


def test_every_node_page_opens_in_the_docs_panel(comfy, comfy_server):
    info = comfy_server.get_json("/object_info")
    nodes = sorted(name for name, node in info.items() if node["python_module"].endswith(comfy_server.module))
    assert nodes == sorted(p.stem for p in DOCS.glob("*.md")), "every registered node has its page, and only those"

    for node in nodes:
        comfy.page.evaluate(PLACE_AND_SELECT, node)
        comfy.page.locator('[data-testid="info-button"]').click(timeout=10_000)
        panel = comfy.page.locator(".node-help-content")
        expected = _first_paragraph((DOCS / f"{node}.md").read_text())
        panel.locator(".markdown-content").filter(has_text=expected).wait_for(timeout=10_000)
        assert panel.locator(".fallback-content").count() == 0, node
        heading = panel.locator(".markdown-content h1").first.text_content()
        assert heading.strip() == (DOCS / f"{node}.md").read_text().splitlines()[0].removeprefix("# "), node
    # The frontend asks for the locale's page (docs/<NodeClass>/en.md) first; sdopt has one language.
    locale_probes = re.compile(r"status of 404 .*/extensions/sdopt/docs/SDOpt\w+/\w+\.md$")
    unexpected = [m for m in comfy.sdopt_messages() if not locale_probes.search(m)]
    assert unexpected == [], f"frontend {comfy.frontend_version}"
