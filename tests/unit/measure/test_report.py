"""Report: JSON schema (as documented), markdown table, PNG chart."""
import json
import re
from pathlib import Path

import pytest

from sdopt.optim.profiler import SamplingRun
from sdopt.optim.report import Report, SCHEMA_VERSION

DOC = Path(__file__).resolve().parents[3] / "docs" / "report-schema.md"


@pytest.fixture()
def report():
    runs = []
    for label, steps in (("baseline", 3), ("fp16", 2)):
        run = SamplingRun(label, "cpu", [{"node": "SDOptAttention", "requested": "auto", "active": "sdpa", "note": "x"}])
        with run.memory_scope():
            run.start()
            for _ in range(steps):
                run.step()
            run.finish()
        runs.append(run.result().to_dict())
    nodes = [{"id": "3", "class_type": "KSampler", "seconds": 1.5, "peak_memory_bytes": 10 * 2**20}]
    notes = [{"node": "SDOptVAEPrecision", "requested": "fp16+guard", "active": "bf16", "note": "redid 1 decode"}]
    return Report(device="cpu", comfyui="0.3.64", runs=runs, nodes=nodes, optimizations=notes)


def test_json_has_the_documented_fields_and_types(report, tmp_path):
    data = json.loads(report.save_json(tmp_path / "sub" / "r.json").read_text())
    assert data["sdopt_report"] == SCHEMA_VERSION
    assert isinstance(data["device"], str) and isinstance(data["torch"], str) and data["comfyui"] == "0.3.64"
    run = data["runs"][0]
    assert run["label"] == "baseline" and len(run["steps"]) == 3
    for key in ("sampler_total_s", "first_step_s", "steady_it_per_s"):
        assert isinstance(run[key], float)
    assert isinstance(run["peak_memory_bytes"], int) and run["memory_kind"] in ("vram_allocated", "ram_rss")
    assert set(run["steps"][0]) == {"index", "seconds"}
    assert set(run["optimizations"][0]) == {"node", "requested", "active", "note"}
    assert set(data["nodes"][0]) == {"id", "class_type", "seconds", "peak_memory_bytes"}
    assert Report.from_dict(data).to_dict() == data
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_schema_doc_names_every_field(report):
    documented = set(re.findall(r"`([a-z_]+)`", DOC.read_text()))
    data = report.to_dict()
    fields = set(data) | set(data["runs"][0]) | set(data["runs"][0]["steps"][0]) | set(data["nodes"][0])
    fields |= set(data["runs"][0]["optimizations"][0])
    assert fields <= documented, f"undocumented: {fields - documented}"


def test_markdown_lists_runs_optimizations_and_nodes(report):
    text = report.markdown()
    assert "| baseline | 3 |" in text and "| fp16 | 2 |" in text
    assert "(RAM)" in text and "VRAM" not in text
    assert "| baseline | SDOptAttention | auto | sdpa | x |" in text
    assert "| (outside sampling) | SDOptVAEPrecision | fp16+guard | bf16 | redid 1 decode |" in text
    assert "| 3 | KSampler | 1.500 | 10.0 |" in text


def test_empty_report_says_what_is_missing():
    assert "No sampling run was profiled" in Report(device="cpu").markdown()
    cached = Report(device="cpu", note="No sampling ran in this prompt: ComfyUI reused cached results.")
    assert cached.markdown().splitlines()[2:] == [cached.note]


def test_chart_is_a_png(report, tmp_path):
    path = report.save_chart(tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_from_dict_rejects_other_json():
    with pytest.raises(ValueError, match="not an sdopt report"):
        Report.from_dict({"hello": 1})
