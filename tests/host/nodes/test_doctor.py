"""SDOptDoctor in real ComfyUI: the checks run inside the server process, read ComfyUI live, cover
every sdopt node, travel to the browser as one ``sdopt.doctor`` event and are saved as JSON."""
import json

import pytest

from sdopt.nodes.checks import OK, STATUSES

NODE = "SDOptDoctor"


@pytest.fixture(scope="module")
def examined(comfy_host):
    outcome = comfy_host.run({"1": {"class_type": NODE, "inputs": {"filename_prefix": "sdopt/doctor"}}})
    events = [data for event, data in comfy_host.host._server.events if event == "sdopt.doctor"]
    return outcome, events


def test_one_event_with_every_check_and_its_fix(examined):
    outcome, events = examined
    (event,) = events
    assert event["node"] == "1"
    checks = event["checks"]
    assert all(c["status"] in STATUSES and c["tried"] and c["result"] for c in checks)
    assert all(c["fix"] for c in checks if c["status"] != OK), [c for c in checks if c["status"] != OK and not c["fix"]]
    assert event["table"].startswith("| check | status | result | fix | tried |")
    assert json.loads(open(event["path"]).read()) == checks
    assert outcome.outputs.get("1", {}) == {}, "no output cards in the queue: the table travels as the event"


def test_comfyui_is_read_from_the_running_server(examined, comfy_host):
    rows = {c["check"]: c for c in examined[1][0]["checks"]}
    from comfyui_version import __version__

    assert rows["ComfyUI"]["status"] == OK and rows["ComfyUI"]["result"].startswith(f"{__version__} at ")
    assert "memory" in rows["ComfyUI memory mode"]["tried"]
    device = str(comfy_host.pack("nodes.checks").comfyui_device())
    assert f"on {device}" in rows["device"]["tried"]


def test_every_sdopt_node_says_which_modes_run_here(examined, comfy_host):
    rows = {c["check"] for c in examined[1][0]["checks"]}
    names = comfy_host.pack("nodes.registry").NODE_DISPLAY_NAME_MAPPINGS
    expected = {f"node: {title}" for node, title in names.items() if node != NODE}
    assert expected <= rows, expected - rows
