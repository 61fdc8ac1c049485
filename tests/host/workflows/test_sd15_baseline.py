"""The baseline workflow, headless in real ComfyUI, on the mini checkpoint at 128x128 with 2 steps."""
import json
from pathlib import Path

import pytest
from PIL import Image

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"

SMALL = ["KSampler.steps=2", "EmptyLatentImage.width=128", "EmptyLatentImage.height=128"]


@pytest.fixture(scope="module")
def baseline(comfy_host):
    comfy_host.host.clear_cache()
    return comfy_host.run(WORKFLOWS / "sd15_baseline.json", SMALL)


def test_report_has_two_steps_and_consistent_totals(baseline):
    report = baseline.report.to_dict()
    assert report["sdopt_report"] == 1 and report["comfyui"]
    (run,) = report["runs"]
    assert run["label"] == "baseline"
    assert len(run["steps"]) == 2
    assert run["sampler_total_s"] >= sum(step["seconds"] for step in run["steps"])
    assert run["peak_memory_bytes"] > 0
    assert run["memory_kind"] in ("ram_rss", "vram_allocated")
    assert run["optimizations"] == [], "the baseline has no sdopt optimization"


def test_saved_report_matches_and_lists_every_executed_node(baseline):
    saved = json.loads(baseline.report_path.read_text())
    assert saved == baseline.report.to_dict()
    classes = [node["class_type"] for node in saved["nodes"]]
    for expected in ("CheckpointLoaderSimple", "KSampler", "VAEDecode", "SDOptProfileReport"):
        assert expected in classes
    ksampler = next(node for node in saved["nodes"] if node["class_type"] == "KSampler")
    assert ksampler["seconds"] >= saved["runs"][0]["sampler_total_s"]


def test_output_image_has_the_requested_size(baseline):
    images = [path for path in baseline.images if "baseline" in path.name]
    assert len(images) == 1
    assert Image.open(images[0]).size == (128, 128)
    chart = next(path for path in baseline.images if path.name.startswith("profile"))
    assert Image.open(chart).format == "PNG"


def test_report_node_shows_the_table(baseline):
    (report_output,) = [out for out in baseline.outputs.values() if "sdopt_report" in out]
    assert "| baseline | 2 |" in report_output["text"][0]


def test_report_reruns_on_every_queue(comfy_host, baseline):
    again = comfy_host.run(WORKFLOWS / "sd15_baseline.json", SMALL)
    assert again.report_path != baseline.report_path
    # Every node but the report is cached, so the report of the second queue has no run of its own.
    assert again.report.runs == []
    assert "ComfyUI reused cached results" in again.report.note
    assert [node["class_type"] for node in again.report.nodes] == ["SDOptProfileReport"]


def test_cli_errors_for_unknown_node_and_missing_model(comfy_host, tmp_path):
    from sdopt.errors import UserError

    workflow = json.loads((WORKFLOWS / "sd15_baseline.json").read_text())
    loader = next(node for node in workflow["nodes"] if node["type"] == "CheckpointLoaderSimple")
    loader["widgets_values"] = ["nope.safetensors"]
    with pytest.raises(UserError, match=r"missing model file 'nope.safetensors'.*sdopt make-model mini --out"):
        comfy_host.run(workflow, SMALL)
    workflow["nodes"].append({"id": 99, "type": "NotANode", "mode": 0, "inputs": [], "outputs": []})
    with pytest.raises(UserError, match="unknown node type NotANode"):
        comfy_host.run(workflow, SMALL)
    with pytest.raises(UserError, match="matches no node"):
        comfy_host.run(WORKFLOWS / "sd15_baseline.json", ["KSamplerX.steps=2"])
