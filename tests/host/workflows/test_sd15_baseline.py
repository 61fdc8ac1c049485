"""The baseline workflow, headless in real ComfyUI, on the mini checkpoint at 64x64 with 2 steps."""
import json

import pytest
from PIL import Image


@pytest.fixture(scope="module")
def baseline(comfy_host):
    comfy_host.host.clear_cache()
    return comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", comfy_host.SMALL)


def test_report_has_two_steps_and_consistent_totals(baseline):
    report = baseline.report.to_dict()
    assert report["sdopt_report"] == 2 and report["comfyui"]
    assert report["cached"] is False
    (run,) = report["runs"]
    assert run["label"] == "baseline"
    assert len(run["steps"]) == 2
    assert run["sampler_total_s"] >= sum(step["seconds"] for step in run["steps"])
    assert run["peak_memory_bytes"] > 0
    assert run["memory_kind"] in ("ram_rss", "vram_allocated")
    assert run["optimizations"] == [], "the baseline has no sdopt optimization"
    assert report["optimizations"] == []


def test_saved_report_matches_and_lists_every_executed_node(baseline):
    saved = json.loads(baseline.report_path.read_text())
    assert saved == baseline.report.to_dict()
    classes = [node["class_type"] for node in saved["nodes"]]
    for expected in ("CheckpointLoaderSimple", "KSampler", "VAEDecode", "SDOptProfiler"):
        assert expected in classes
    assert "SDOptProfileReport" not in classes, "the report is built while its own node runs"
    ksampler = next(node for node in saved["nodes"] if node["class_type"] == "KSampler")
    assert ksampler["seconds"] >= saved["runs"][0]["sampler_total_s"]


def test_output_image_has_the_requested_size(baseline):
    images = [path for path in baseline.images if "baseline" in path.name]
    assert len(images) == 1
    assert Image.open(images[0]).size == (64, 64)
    chart = next(path for path in baseline.images if path.name.startswith("profile"))
    assert Image.open(chart).format == "PNG"


def test_report_table_lists_the_run(baseline):
    assert "| baseline | 2 |" in baseline.report.markdown()


def test_report_reruns_on_every_queue(comfy_host, baseline):
    again = comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", comfy_host.SMALL)
    assert again.report_path != baseline.report_path
    # Every node but the report is cached: the second queue shows the first one's figures, marked cached.
    assert again.report.cached is True
    assert again.report.runs == baseline.report.runs
    assert any("ComfyUI reused cached results" in note for note in again.report.notes)


def test_cli_errors_for_unknown_node_and_missing_model(comfy_host):
    from sdopt.errors import UserError

    workflow = json.loads((comfy_host.WORKFLOWS / "sd15_baseline.json").read_text())
    loader = next(node for node in workflow["nodes"] if node["type"] == "CheckpointLoaderSimple")
    loader["widgets_values"] = ["nope.safetensors"]
    with pytest.raises(UserError, match=r"missing model file 'nope.safetensors'.*sdopt make-model NAME --out .*nope.safetensors.*NAME: tiny, mini, full, sdxl-tiny"):
        comfy_host.run(workflow, comfy_host.SMALL)
    workflow["nodes"].append({"id": 99, "type": "NotANode", "mode": 0, "inputs": [], "outputs": []})
    with pytest.raises(UserError, match="unknown node type NotANode"):
        comfy_host.run(workflow, comfy_host.SMALL)
    with pytest.raises(UserError, match="matches no node"):
        comfy_host.run(comfy_host.WORKFLOWS / "sd15_baseline.json", ["KSamplerX.steps=2"])
