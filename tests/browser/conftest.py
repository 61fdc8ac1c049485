"""Browser tier: ComfyUI started by ``sdopt.tools.serve``, driven through its web UI by Debian's Chromium.

Skipped, with the reason shown, when the ``playwright`` package, /usr/bin/chromium ($SDOPT_CHROMIUM)
or $COMFYUI_PATH is missing. Playwright's own browser downloads are never used. The server gets a
free port and temporary output, input, temp, user and database locations; the checkpoints come from
$SDOPT_TEST_MODELS (the SD1.5, SDXL, SD3.5 and Flux mini checkpoints are generated there when absent;
Flux's text encoder into its text_encoders folder).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

# The families whose mini checkpoints the example workflows load (generated into $SDOPT_TEST_MODELS when absent).
WORKFLOW_FAMILIES = ("sd15", "sdxl", "sd35", "flux")
CHROMIUM = Path(os.environ.get("SDOPT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# Start-up dialogs that would cover the canvas on a fresh user folder.
SETTINGS = {"Comfy.TutorialCompleted": True}
VIEWPORT = {"width": 1600, "height": 1000}


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives ComfyUI's web UI in Chromium (tests/browser)")


class Server:
    """The running ComfyUI: its URL, the folder name it serves the pack under, and its log."""

    def __init__(self, url: str, module: str, log: Path):
        self.url, self.module, self.log = url, module, log

    def get_json(self, path: str):
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.load(response)

    def wait_for_history(self, count: int, timeout: float) -> dict:
        """The history once it holds ``count`` finished prompts (ComfyUI adds a prompt there when it ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get_json("/api/history")
            if len(history) >= count:
                return history
            time.sleep(0.5)
        raise AssertionError(f"no finished prompt after {timeout:.0f} s; server log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# Module scope, not session: the server (with a model loaded) and Playwright (whose sync API keeps an
# asyncio loop running in this thread, so asyncio.run() fails) must be gone before the other tiers run.
@pytest.fixture(scope="module")
def comfy_server(tmp_path_factory):
    pytest.importorskip("playwright.sync_api", reason="browser tier: the playwright package is not installed (pip install playwright)")
    if not CHROMIUM.exists():
        pytest.skip(f"browser tier: no Chromium at {CHROMIUM} (apt-get install -y chromium, or set SDOPT_CHROMIUM)")
    comfyui = os.environ.get("COMFYUI_PATH")
    if not comfyui:
        pytest.skip("browser tier: COMFYUI_PATH is not set (point it at a ComfyUI checkout to run these)")
    from sdopt.errors import UserError
    from sdopt.tools.serve import LINK_NAME, free_port, install_pack, serve, stop, wait_ready

    root = tmp_path_factory.mktemp("browser")
    checkpoints = Path(os.environ.get("SDOPT_TEST_MODELS") or root / "checkpoints")
    from sdopt.families import FAMILIES
    from sdopt.tools.modelgen import ensure_checkpoint

    text_encoders = checkpoints / "text_encoders"
    for family in (FAMILIES[name] for name in WORKFLOW_FAMILIES):
        apart = family.text_encoder_filename("mini")
        ensure_checkpoint(family.model_name("mini"), checkpoints / family.checkpoint_filename("mini"),
                          text_encoder_out=text_encoders / apart if apart else None)
    models = root / "models"
    models.mkdir()
    (models / "checkpoints").symlink_to(checkpoints.resolve(), target_is_directory=True)
    (models / "text_encoders").symlink_to(text_encoders.resolve(), target_is_directory=True)
    output, user = root / "output", root / "user"
    (user / "default").mkdir(parents=True)
    (user / "default" / "comfy.settings.json").write_text(json.dumps(SETTINGS))
    output.mkdir()

    link = Path(comfyui) / "custom_nodes" / LINK_NAME
    linked_here = not (link.is_symlink() or link.exists())
    try:
        module = install_pack(Path(comfyui)).name  # ComfyUI names the pack's web routes after its folder
    except UserError as error:
        pytest.fail(f"COMFYUI_PATH is set but unusable: {error}")
    port, log = free_port(), root / "server.log"
    args = ["--output-directory", str(output), "--user-directory", str(user), "--input-directory", str(root / "input"),
            "--temp-directory", str(root), "--database-url", "sqlite:///:memory:"]
    with log.open("w") as log_file:
        process = serve(Path(comfyui), models, port, extra_args=args, config_dir=root, stdout=log_file,
                        stderr=subprocess.STDOUT, die_with_parent=True)
    server = Server(f"http://127.0.0.1:{port}", module, log)
    try:
        try:
            wait_ready(server.url + "/object_info/SDOptProfileReport", process, timeout=180)
        except RuntimeError as error:
            pytest.fail(f"{error}\n{server.log_tail()}")
        if "SDOptProfileReport" not in server.get_json("/object_info/SDOptProfileReport"):
            pytest.fail("the server runs but did not load sdopt:\n" + server.log_tail())
        yield server
    finally:
        stop(process)
        if linked_here and link.is_symlink():
            link.unlink()  # leave the ComfyUI tree as it was


@pytest.fixture(scope="module")
def browser(comfy_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class ComfyPage:
    """One ComfyUI tab, with the console messages it logged."""

    def __init__(self, page, server: Server):
        self.page, self.server = page, server
        self.messages: list[str] = []
        page.on("console", lambda m: self.messages.append(f"{m.type}: {m.text} @ {m.location.get('url', '')}"))
        page.on("pageerror", lambda e: self.messages.append(f"pageerror: {e} {getattr(e, 'stack', '') or ''}"))

    def open(self):
        self.page.goto(self.server.url)
        self.wait_ready()

    def wait_ready(self):
        self.page.wait_for_function(
            "() => window.app?.canvas && (app.rootGraph ?? app.graph)"
            " && app.extensions?.some((e) => e.name === 'sdopt.ProfileReport')",
            timeout=60_000,
        )

    @property
    def frontend_version(self) -> str:
        return self.page.evaluate("window.__COMFYUI_FRONTEND_VERSION__ ?? '?'")

    def frontend_at_least(self, major: int, minor: int) -> bool:
        version = tuple(int(part) for part in re.findall(r"\d+", self.frontend_version)[:2])
        return version >= (major, minor)

    def sdopt_messages(self) -> list[str]:
        """Errors and warnings that come from sdopt.js (logged there, or with it in the stack) or name the extension."""
        return [m for m in self.messages if m.split(":", 1)[0] in ("error", "warning", "pageerror")
                and ("/extensions/sdopt/" in m or "sdopt.ProfileReport" in m)]

    def command(self, key: str):
        """Press a shortcut on the page, not inside a text field (the frontend ignores shortcuts there)."""
        self.page.evaluate("document.activeElement?.blur()")
        self.page.keyboard.press(key)

    def open_workflow(self, path: Path) -> list[dict]:
        """Open a workflow file through the Open dialog (Ctrl+O; else File > Open's command), as a user does."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            with self.page.expect_file_chooser(timeout=3_000) as chooser:
                self.command("Control+o")
        except PlaywrightTimeout:  # the shortcut is not bound yet, or focus is in a widget
            with self.page.expect_file_chooser(timeout=10_000) as chooser:
                self.page.evaluate("app.extensionManager.command.execute('Comfy.OpenWorkflow')")
        chooser.value.set_files(str(path))
        ids = [node["id"] for node in json.loads(path.read_text())["nodes"]]
        self.page.wait_for_function(
            "(ids) => { const g = app.rootGraph ?? app.graph; return ids.every((id) => g.getNodeById(id)); }", arg=ids
        )
        return self.page.evaluate("""() => (app.rootGraph ?? app.graph).nodes.map((n) => ({
            id: n.id, type: n.type, registered: !!LiteGraph.registered_node_types[n.type], errors: !!n.has_errors }))""")

    def missing_nodes_dialogs(self) -> list[str]:
        """Visible dialogs that report missing nodes (1.27/1.32 open one; 1.49 marks the nodes instead)."""
        return self.page.evaluate("""() => [...document.querySelectorAll('[role=dialog], .p-dialog')]
            .filter((d) => d.offsetParent !== null && /missing|not found/i.test(d.textContent))
            .map((d) => d.textContent.slice(0, 300))""")

    def set_widgets(self, node_type: str, **values):
        self.page.evaluate("""([type, values]) => {
            const node = (app.rootGraph ?? app.graph).nodes.find((n) => n.type === type);
            for (const [name, value] of Object.entries(values)) {
                const widget = node.widgets.find((w) => w.name === name);
                widget.value = value;
                widget.callback?.(value);
            }
        }""", [node_type, values])

    def node_id(self, node_type: str) -> int:
        return self.page.evaluate("(type) => (app.rootGraph ?? app.graph).nodes.find((n) => n.type === type).id", node_type)

    def focus_node(self, node_type: str, scale: float = 1.0):
        """Zoom to ``scale`` and put the node's top left near the canvas' top left (DOM widgets show at scale ≥ 0.6)."""
        self.page.evaluate("""([type, scale]) => {
            const node = (app.rootGraph ?? app.graph).nodes.find((n) => n.type === type);
            const ds = app.canvas.ds;
            ds.scale = scale;
            ds.offset[0] = -node.pos[0] + 120;
            ds.offset[1] = -node.pos[1] + 140;
            app.canvas.setDirty(true, true);
        }""", [node_type, scale])
        self.page.wait_for_timeout(300)


@pytest.fixture()
def open_comfy(browser, comfy_server):
    """Opens ComfyUI in a fresh browser context: ``open_comfy(viewport=None) -> ComfyPage``."""
    contexts = []

    def open_page(viewport: dict | None = None) -> ComfyPage:
        contexts.append(browser.new_context(viewport=viewport or VIEWPORT))
        page = ComfyPage(contexts[-1].new_page(), comfy_server)
        page.open()
        return page

    yield open_page
    for context in contexts:
        context.close()


@pytest.fixture()
def comfy(open_comfy) -> ComfyPage:
    return open_comfy()
