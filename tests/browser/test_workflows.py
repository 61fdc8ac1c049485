"""The example workflows in ComfyUI's web UI: they open without missing nodes or sdopt.js errors and with
their widgets as saved, the Templates dialog offers them with thumbnails drawn from the saved files, and
the baseline runs and shows its profile on the node."""
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
REPORT = "SDOptProfileReport"
# The JPEG comment of each thumbnail: the digest of the workflow it was drawn from.
THUMBNAIL_OF = "sdopt thumbnail of workflow sha256 "

TABLES = """() => [...document.querySelectorAll('.sdopt-report table')].map((t) => ({
    caption: t.caption?.textContent ?? '',
    head: [...t.tHead.rows[0].cells].map((c) => c.textContent),
    rows: [...t.tBodies[0].rows].map((r) => [...r.cells].map((c) => c.textContent)),
}))"""

SERIALIZED_NODES = "() => (app.rootGraph ?? app.graph).serialize().nodes"

# How the report's element looks where it is shown: legible, read-only and not cut off.
REPORT_BOX = """() => {
    const el = [...document.querySelectorAll('.sdopt-report')].find((e) => e.offsetParent !== null);
    if (!el) return null;
    const cells = [...el.querySelectorAll('td, th, p, li')];
    return {
        minFontPx: Math.min(...cells.map((c) => parseFloat(getComputedStyle(c).fontSize))),
        editable: el.querySelectorAll('textarea, input, [contenteditable=true]').length,
        clipped: Math.max(el.scrollHeight - el.clientHeight, el.scrollWidth - el.clientWidth),
        inVueNode: !!el.closest('[data-node-id]'),
    };
}"""


def _workflow_digest(path: Path) -> str:
    """The digest of a workflow's content (key order, spacing and line endings aside)."""
    canonical = json.dumps(json.loads(path.read_text()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _saved_widgets(nodes: list[dict]) -> dict:
    return {str(n["id"]): n.get("widgets_values") or [] for n in nodes}


def test_sdopt_js_uses_only_the_public_frontend_api():
    source = (REPO / "web" / "sdopt.js").read_text()
    imports = re.findall(r'^import .* from "([^"]+)";', source, flags=re.M)
    assert sorted(imports) == ["../../scripts/api.js", "../../scripts/app.js"]
    assert "inputEl" not in source


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[path.stem for path in WORKFLOWS])
def test_workflow_opens_without_missing_nodes(comfy, workflow):
    nodes = comfy.open_workflow(workflow)
    comfy.page.wait_for_timeout(500)  # the missing-nodes dialog opens after the graph is configured
    assert [n["type"] for n in nodes if not n["registered"] or n["errors"]] == []
    assert comfy.missing_nodes_dialogs() == []
    # Each widget shows its saved value (a node whose inputs changed would shift them).
    assert _saved_widgets(comfy.page.evaluate(SERIALIZED_NODES)) == _saved_widgets(json.loads(workflow.read_text())["nodes"])
    if any(n["type"] == REPORT for n in nodes):
        comfy.page.wait_for_selector(".sdopt-report", state="attached", timeout=5_000)
    assert comfy.sdopt_messages() == [], f"frontend {comfy.frontend_version}"


def test_templates_dialog_lists_the_workflows_with_thumbnails(comfy_server):
    import urllib.request

    templates = comfy_server.get_json("/api/workflow_templates")
    assert sorted(templates.get(comfy_server.module, [])) == [path.stem for path in WORKFLOWS]
    for path in WORKFLOWS:
        thumbnail = path.with_suffix(".jpg")
        assert thumbnail.exists() and thumbnail.stat().st_size < 100_000, thumbnail
        with urllib.request.urlopen(f"{comfy_server.url}/api/workflow_templates/{comfy_server.module}/{thumbnail.name}") as response:
            assert response.headers["Content-Type"] == "image/jpeg"


def test_baseline_run_shows_the_report_table_and_chart(comfy, comfy_server):
    comfy.open_workflow(REPO / "workflows" / "sd15_baseline.json")
    comfy.set_widgets("EmptyLatentImage", width=128, height=128)
    comfy.set_widgets("KSampler", steps=2)
    comfy.command("Control+Enter")
    history = comfy_server.wait_for_history(1, timeout=180)
    (entry,) = history.values()
    assert entry["status"]["status_str"] == "success", entry["status"]

    report_id = comfy.node_id(REPORT)
    comfy.page.wait_for_selector(".sdopt-report table", state="attached", timeout=15_000)
    tables = {t["caption"]: t for t in comfy.page.evaluate(TABLES)}
    runs = tables["Sampling runs"]
    assert "steady it/s" in runs["head"]
    (run,) = runs["rows"]
    assert run[:2] == ["baseline", "2"]
    assert run[runs["head"].index("warm-up steps")] == "–", "stock ComfyUI compiles nothing"
    assert run[runs["head"].index("peak memory MiB")].endswith(("RAM", "VRAM"))
    assert run[runs["head"].index("model")] == "SD1.5"
    assert any(row[1] == "KSampler" for row in tables["Nodes"]["rows"])
    assert comfy.page.locator(".sdopt-report .sdopt-cached").count() == 0

    # The chart comes through ComfyUI's own image preview.
    stored = comfy.page.evaluate("(id) => (app.rootGraph ?? app.graph).getNodeById(id).properties.sdopt_report", report_id)
    assert stored["report"]["runs"][0]["label"] == "baseline"
    saved = comfy.page.evaluate("(id) => (app.rootGraph ?? app.graph).serialize().nodes.find((n) => String(n.id) === String(id))", report_id)
    assert saved["widgets_values"] == ["sdopt/profile"], "the report widget must not be saved as a widget value"
    chart = stored["chart"]["filename"]
    comfy.page.wait_for_function(
        """([id, name]) => (app.rootGraph ?? app.graph).getNodeById(id).imgs
               ?.some((img) => img.complete && img.naturalWidth > 0 && img.src.includes(name))""",
        arg=[report_id, chart], timeout=15_000,
    )
    # The queue makes one card per entry of every key of the node's ui: only the chart must be there.
    outputs = entry["outputs"][str(report_id)]
    assert list(outputs) == ["images"]
    assert [(i["filename"], i["type"]) for i in outputs["images"]] == [(chart, "output")]

    comfy.focus_node(REPORT)
    box = comfy.page.evaluate(REPORT_BOX)
    assert box and box["minFontPx"] >= 12 and box["editable"] == 0 and box["clipped"] <= 1, box

    # Queued again unchanged, ComfyUI serves the sampling from its cache: the report says so.
    comfy.command("Control+Enter")
    comfy_server.wait_for_history(2, timeout=60)
    comfy.page.wait_for_selector(".sdopt-report .sdopt-cached", timeout=15_000)
    assert {t["caption"]: t for t in comfy.page.evaluate(TABLES)}["Sampling runs"]["rows"] == [run]

    # The table is saved in the node's properties: it comes back after a reload. (1.49 saves the open
    # workflow 512 ms after its last change, a user's edits included: give it that time.)
    comfy.page.wait_for_timeout(1_000)
    comfy.page.reload()
    comfy.wait_ready()
    comfy.page.wait_for_selector(".sdopt-report table", state="attached", timeout=15_000)
    assert {t["caption"]: t for t in comfy.page.evaluate(TABLES)}["Sampling runs"]["rows"] == [run]

    # Nodes 2.0 (Vue nodes): the same element moves into the Vue node; it must stay a table and not be cut off.
    # (1.27's experimental Vue nodes render no DOM widget of any extension; 1.32 announces Nodes 2.0.)
    if comfy.frontend_at_least(1, 32):
        comfy.page.evaluate("app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true)")
        try:
            comfy.page.wait_for_selector("[data-node-id] .sdopt-report table", timeout=15_000)
            box = comfy.page.evaluate(REPORT_BOX)
            assert box and box["inVueNode"] and box["editable"] == 0 and box["clipped"] <= 1, box
        finally:
            comfy.page.evaluate("app.extensionManager.setting.set('Comfy.VueNodes.Enabled', false)")
    assert comfy.sdopt_messages() == [], f"frontend {comfy.frontend_version}"


def test_a_report_from_dynamic_vram_shows_the_mode_and_what_it_mapped(comfy):
    """A report saved in a workflow (the node's property) as ComfyUI 0.38's dynamic VRAM writes it."""
    gib = 2**30
    report = {"report": {
        "device": "cuda:0", "torch": "2.11.0", "comfyui": "0.38.0", "memory_mode": "dynamic VRAM",
        "runs": [{"label": "fast", "steps": [], "first_step_s": 1.0, "steady_it_per_s": 2.0, "sampler_total_s": 3.0,
                  "peak_memory_bytes": gib, "memory_kind": "vram_allocated", "peak_outside_allocator_bytes": 3 * gib // 2,
                  "model_family": "SD1.5"}],
        "nodes": [{"id": "3", "class_type": "KSampler", "seconds": 1.0, "peak_memory_bytes": gib, "peak_outside_allocator_bytes": gib // 2},
                  {"id": "8", "class_type": "VAEDecode", "seconds": 0.5, "peak_memory_bytes": gib}],
    }}
    comfy.page.evaluate("""([type, data]) => {
        const graph = app.rootGraph ?? app.graph;
        graph.clear();
        const node = LiteGraph.createNode(type);
        node.properties.sdopt_report = data;
        graph.add(node);
        node.onConfigure({});
        app.canvas.setDirty(true, true);
    }""", [REPORT, report])
    comfy.page.wait_for_selector(".sdopt-report table", state="attached", timeout=5_000)
    tables = {t["caption"]: t for t in comfy.page.evaluate(TABLES)}
    runs, nodes = tables["Sampling runs"], tables["Nodes"]
    assert runs["rows"][0][runs["head"].index("peak memory MiB")] == "1,024.0 VRAM + 1,536.0 dynamic VRAM"
    assert [row[3] for row in nodes["rows"]] == ["1,024.0 + 512.0 dynamic VRAM", "1,024.0"]
    assert "ComfyUI 0.38.0 (dynamic VRAM)" in comfy.page.locator(".sdopt-report .sdopt-muted").first.text_content()


@pytest.mark.skipif(not os.environ.get("SDOPT_WRITE_THUMBNAILS"), reason="set SDOPT_WRITE_THUMBNAILS=1 to rewrite workflows/*.jpg")
def test_write_template_thumbnails(open_comfy, tmp_path):
    """The Templates dialog's thumbnails: each workflow as it opens, cropped to its nodes, without the UI."""
    from PIL import Image

    # Drawn at 100 % (zoomed out, the canvas skips text), then scaled down.
    viewport = {"width": 2200, "height": 2000}
    comfy = open_comfy(viewport)
    comfy.page.evaluate("app.extensionManager.command.execute('Workspace.ToggleFocusMode')")
    comfy.page.evaluate("app.extensionManager.setting.set('Comfy.Graph.CanvasInfo', false)")
    for path in WORKFLOWS:
        comfy.open_workflow(path)
        assert _saved_widgets(comfy.page.evaluate(SERIALIZED_NODES)) == _saved_widgets(json.loads(path.read_text())["nodes"])
        left, top, right, bottom = comfy.page.evaluate("""() => {
            const nodes = (app.rootGraph ?? app.graph).nodes, ds = app.canvas.ds;
            const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1])) - 50;
            ds.scale = 1;
            ds.offset[0] = 20 - x0;
            ds.offset[1] = 20 - y0;
            app.canvas.setDirty(true, true);
            const x1 = Math.max(...nodes.map((n) => n.pos[0] + n.size[0])), y1 = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
            return [8, 8, x1 - x0 + 32, y1 - y0 + 32].map(Math.round);
        }""")
        assert right <= viewport["width"] and bottom <= viewport["height"], f"{path.name} does not fit the viewport"
        comfy.page.wait_for_timeout(500)
        png = tmp_path / f"{path.stem}.png"
        comfy.page.screenshot(path=str(png), clip={"x": left, "y": top, "width": right - left, "height": bottom - top})
        with Image.open(png) as image:
            image = image.convert("RGB")
            image.thumbnail((800, 800), Image.LANCZOS)
            image.save(path.with_suffix(".jpg"), quality=82, optimize=True, comment=THUMBNAIL_OF + _workflow_digest(path))


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[path.stem for path in WORKFLOWS])
def test_thumbnail_was_drawn_from_the_saved_workflow(workflow):
    """Rewrite the thumbnails (SDOPT_WRITE_THUMBNAILS=1, above; pytest runs it first) whenever a workflow changes."""
    from PIL import Image

    with Image.open(workflow.with_suffix(".jpg")) as thumbnail:
        comment = thumbnail.info.get("comment", b"").decode()
    assert comment == THUMBNAIL_OF + _workflow_digest(workflow), (
        f"{workflow.name} changed since its thumbnail was drawn: run this tier with SDOPT_WRITE_THUMBNAILS=1"
    )
