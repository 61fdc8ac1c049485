"""The sdopt Doctor node in ComfyUI's web UI: queued on its own, it shows the checks as a table on the
node (status, result and fix per row, what was tried under each), kept across a reload."""
import pytest

pytestmark = pytest.mark.browser

DOCTOR = "SDOptDoctor"
CAPTION = "What sdopt can run here"

DOCTOR_TABLE = """(caption) => {
    const t = [...document.querySelectorAll('.sdopt-report table')].find((t) => t.caption?.textContent === caption);
    if (!t) return null;
    const rows = [...t.tBodies[0].rows];
    return {
        head: [...t.tHead.rows[0].cells].map((c) => c.textContent),
        rows: rows.filter((r) => !r.classList.contains('sdopt-note')).map((r) => ({
            cells: [...r.cells].map((c) => c.textContent), className: r.className })),
        notes: rows.filter((r) => r.classList.contains('sdopt-note')).map((r) => r.textContent),
    };
}"""


def test_doctor_node_shows_its_table(comfy, comfy_server):
    comfy.page.evaluate("""(type) => {
        const graph = app.rootGraph ?? app.graph;
        graph.clear();
        const node = LiteGraph.createNode(type);
        node.pos = [100, 100];
        graph.add(node);
        app.canvas.setDirty(true, true);
    }""", DOCTOR)
    comfy.page.wait_for_selector(".sdopt-report", state="attached", timeout=5_000)
    comfy.command("Control+Enter")
    history = comfy_server.wait_for_history(1, timeout=300)
    (entry,) = history.values()
    assert entry["status"]["status_str"] == "success", entry["status"]

    comfy.page.wait_for_function(f"() => ({DOCTOR_TABLE})({CAPTION!r})", timeout=15_000)
    table = comfy.page.evaluate(DOCTOR_TABLE, CAPTION)
    assert table["head"] == ["check", "status", "result", "fix"]
    rows = {row["cells"][0]: row for row in table["rows"]}
    assert rows["ComfyUI"]["cells"][1] == "ok"
    assert {"device", "inductor", "CUDA graph", "attention: sdpa", "node: sdopt Compile", "node: sdopt Offload"} <= set(rows)
    for row in table["rows"]:
        status = row["cells"][1]
        assert f"sdopt-status-{status}" in row["className"]
        assert (row["cells"][3] == "–") == (status == "ok"), row
    assert len(table["notes"]) == len(table["rows"]) and all(note.startswith("tried: ") for note in table["notes"])

    stored = comfy.page.evaluate(
        "(type) => (app.rootGraph ?? app.graph).nodes.find((n) => n.type === type).properties.sdopt_report", DOCTOR)
    assert [c["check"] for c in stored["checks"]] == [row["cells"][0] for row in table["rows"]]
    comfy.focus_node(DOCTOR)
    comfy.page.wait_for_timeout(1_000)  # the frontend saves the open workflow shortly after its last change
    comfy.page.reload()
    comfy.wait_ready()
    comfy.page.wait_for_function(f"() => ({DOCTOR_TABLE})({CAPTION!r})", timeout=15_000)
    assert comfy.page.evaluate(DOCTOR_TABLE, CAPTION)["rows"] == table["rows"]
    assert comfy.sdopt_messages() == [], f"frontend {comfy.frontend_version}"
