"""Report: JSON schema 2 (as documented), markdown table, PNG chart, and the chart-less fallback."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

from sdopt.measure import report as report_module
from sdopt.measure.profiler import SamplingRun, steady_it_per_s
from sdopt.measure.report import CHART_MISSING, SCHEMA_VERSION, Report, markdown_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "report-schema.md"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def report():
    runs = []
    for label, steps in (("baseline", 3), ("fp16", 2)):
        run = SamplingRun(label, "cpu", [{"node": "SDOptAttention", "requested": "auto", "active": "sdpa", "note": "x"}],
                          model_family="SDXL" if label == "baseline" else None)
        with run.memory_scope():
            run.start()
            for _ in range(steps):
                run.step()
            run.finish()
        runs.append(run.result().to_dict())
    nodes = [{"id": "3", "class_type": "KSampler", "seconds": 1.5, "peak_memory_bytes": 10 * 2**20}]
    records = [{"node": "SDOptVAEPrecision", "requested": "fp16+guard", "active": "bf16", "note": "redid 1 decode"}]
    return Report(device="cpu", comfyui="0.3.64", memory_mode="classic memory", runs=runs, nodes=nodes, optimizations=records, notes=["a note"])


def test_json_has_the_documented_fields_and_types(report, tmp_path):
    data = json.loads(report.save_json(tmp_path / "sub" / "r.json").read_text())
    assert SCHEMA_VERSION == 2 and data["sdopt_report"] == 2
    assert isinstance(data["device"], str) and isinstance(data["torch"], str) and data["comfyui"] == "0.3.64"
    assert data["cached"] is False and data["notes"] == ["a note"] and data["memory_mode"] == "classic memory"
    assert "note" not in data, "schema 1's single note is gone"
    run = data["runs"][0]
    assert run["label"] == "baseline" and len(run["steps"]) == 3
    for key in ("sampler_total_s", "first_step_s", "steady_it_per_s"):
        assert isinstance(run[key], float)
    assert isinstance(run["peak_memory_bytes"], int) and run["memory_kind"] in ("vram_allocated", "ram_rss")
    assert set(run["steps"][0]) == {"index", "seconds", "warmup"} and run["steps"][0]["warmup"] == {}
    assert run["steady_steps"] == [1, 2]
    assert run["model_family"] == "SDXL" and data["runs"][1]["model_family"] is None
    assert set(run["optimizations"][0]) == {"node", "requested", "active", "note"}
    assert set(data["nodes"][0]) == {"id", "class_type", "seconds", "peak_memory_bytes"}
    assert set(data["optimizations"][0]) == {"node", "requested", "active", "note"}
    assert Report.from_dict(data).to_dict() == data
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_cached_round_trips_and_defaults_to_false(report):
    report.cached = True
    data = report.to_dict()
    assert data["cached"] is True
    again = Report.from_dict(data)
    assert again.cached is True and again.notes == ["a note"]
    minimal = {"sdopt_report": SCHEMA_VERSION, "device": "cpu", "torch": "2.x"}
    bare = Report.from_dict(minimal)
    assert (bare.cached, bare.notes, bare.runs, bare.nodes, bare.optimizations, bare.comfyui) == (False, [], [], [], [], None)


def test_from_dict_copies_its_lists(report):
    data = report.to_dict()
    again = Report.from_dict(data)
    again.notes.append("more")
    again.runs.append({})
    assert data["notes"] == ["a note"] and len(data["runs"]) == 2


def test_schema_doc_names_every_field(report):
    documented = set(re.findall(r"`([a-z_]+)`", DOC.read_text()))
    data = report.to_dict()
    fields = set(data) | set(data["runs"][0]) | set(data["runs"][0]["steps"][0]) | set(data["nodes"][0])
    fields |= set(data["runs"][0]["optimizations"][0]) | set(data["optimizations"][0])
    assert {"cached", "notes"} <= fields
    assert fields <= documented, f"undocumented: {fields - documented}"
    assert f"version {SCHEMA_VERSION}" in DOC.read_text()


def test_markdown_lists_notes_runs_optimizations_and_nodes(report):
    text = report.markdown()
    lines = text.splitlines()
    assert lines[0] == f"sdopt profile: device cpu, torch {report.torch}, ComfyUI 0.3.64 (classic memory)"
    assert lines[2] == "a note", "notes come right after the header line"
    assert "| baseline | 3 |" in text and "| fp16 | 2 |" in text
    runs = [line for line in lines if line.startswith(("| baseline |", "| fp16 |"))][:2]
    assert runs[0].endswith(" | SDXL |") and runs[1].endswith(" | - |"), "each run names its model family, where known"
    assert "(RAM)" in text and "VRAM" not in text
    assert "| baseline | SDOptAttention | auto | sdpa | x |" in text
    assert "| fp16 | SDOptAttention | auto | sdpa | x |" in text
    assert "| (outside sampling) | SDOptVAEPrecision | fp16+guard | bf16 | redid 1 decode |" in text
    assert "| 3 | KSampler | 1.500 | 10.0 |" in text


def _run(label, records, rate):
    speed_only = [o["node"] for o in records if o["node"] in ("SDOptCompile", "SDOptCUDAGraph")]
    return {"speed_only_nodes": speed_only, "label": label, "steps": [{"index": 0, "seconds": 1.0, "warmup": {}}], "first_step_s": 1.0, "steady_it_per_s": rate,
            "sampler_total_s": 1.0, "peak_memory_bytes": 0, "memory_kind": "ram_rss", "model_family": "SD1.5",
            "optimizations": records}


def test_a_compiled_run_shows_its_eager_twins_rate_and_only_its_own():
    attention = {"node": "SDOptAttention", "requested": "sdpa", "active": "sdpa", "note": ""}
    compiled = {"node": "SDOptCompile", "requested": "compile", "active": "compile", "note": "", "short": ""}
    runs = [_run("stock", [], 2.0), _run("attention", [attention], 2.5), _run("compiled", [attention, compiled], 5.0),
            _run("compiled alone", [compiled], 3.0), _run("other family", [attention], 9.0)]
    runs[-1]["model_family"] = "SDXL"
    assert report_module.eager_twin(runs[2], runs) is runs[1]
    assert report_module.eager_twin(runs[3], runs) is runs[0]
    assert report_module.eager_twin(runs[1], runs) is None, "an eager run has no twin"
    text = Report(device="cpu", runs=runs).markdown()
    assert "| eager twin's steady it/s |" in text
    assert "| SD1.5 | 2.50 it/s (attention), 2.00x |" in text and "| SD1.5 | 2.00 it/s (stock), 1.50x |" in text
    assert "| SD1.5 | - |" in text
    assert "eager twin" not in Report(device="cpu", runs=runs[:2]).markdown(), "no column without a pair"


def test_a_node_that_did_less_than_asked_says_so_in_one_cell_of_the_table():
    fell_short = {"node": "SDOptCompile", "requested": "compile", "active": "compile: 1 compilation(s)", "note": "long story",
                  "short": "2 function(s) ran eagerly (a, b)"}
    fine = {"node": "SDOptAttention", "requested": "sdpa", "active": "sdpa", "note": "", "short": ""}
    text = Report(device="cpu", runs=[_run("r", [fine, fell_short], 1.0)]).markdown()
    assert "| run | optimization | requested | active | did less than asked | note |" in text
    assert "| r | SDOptCompile | compile | compile: 1 compilation(s) | 2 function(s) ran eagerly (a, b) | long story |" in text
    assert "| r | SDOptAttention | sdpa | sdpa | - |  |" in text
    assert "did less than asked" not in Report(device="cpu", runs=[_run("r", [fine], 1.0)]).markdown()


def test_markdown_tables_right_align_the_numbers(report):
    lines = report.markdown().splitlines()
    rules = [line for line in lines if line.startswith("| ---")]
    assert rules == [
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |",  # runs: label, warm-up steps and model left, numbers right
        "| --- | --- | --- | --- | --- |",  # records: text
        "| --- | --- | ---: | ---: |",  # nodes: id and class left, seconds and memory right
    ]


def test_markdown_table_alignment_and_cells():
    assert markdown_table(["a", "b", "c"], [[1, "x", 2.5], ["y", None, 0]], right={0, 2}) == [
        "| a | b | c |",
        "| ---: | --- | ---: |",
        "| 1 | x | 2.5 |",
        "| y | None | 0 |",
    ]
    assert markdown_table(["only"], []) == ["| only |", "| --- |"]


def test_empty_report_says_what_is_missing():
    assert Report(device="cpu").markdown().splitlines() == [
        f"sdopt profile: device cpu, torch {Report(device='cpu').torch}, ComfyUI -",
        "",
        "No sampling run was profiled (is SDOptProfiler on the MODEL path?).",
    ]
    cached = Report(device="cpu", notes=["No sampling ran in this prompt: ComfyUI reused cached results."])
    assert cached.markdown().splitlines()[2:4] == [cached.notes[0], ""]


def test_chart_is_a_png(report, tmp_path):
    path = report.save_chart(tmp_path / "deeper" / "chart.png")
    assert path == tmp_path / "deeper" / "chart.png"
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000
    assert CHART_MISSING not in report.notes


def test_chart_of_a_cached_report_without_nodes_or_runs(tmp_path):
    path = Report(device="cpu", cached=True).save_chart(tmp_path / "empty.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_without_matplotlib_the_chart_is_a_note(report, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    asked = []

    def find_spec(name, *args, **kwargs):
        asked.append(name)
        return None if name == "matplotlib" else real(name, *args, **kwargs)

    monkeypatch.setattr(report_module.importlib.util, "find_spec", find_spec)
    assert report.save_chart(tmp_path / "chart.png") is None
    assert report.save_chart(tmp_path / "chart.png") is None
    assert "matplotlib" in asked
    assert CHART_MISSING == "chart not drawn: matplotlib is not installed (pip install matplotlib)"
    assert report.notes == ["a note", CHART_MISSING], "the note is added once"
    assert not (tmp_path / "chart.png").exists()
    assert CHART_MISSING in report.markdown().splitlines()
    assert report.to_dict()["notes"][-1] == CHART_MISSING


def test_from_dict_rejects_other_json():
    with pytest.raises(ValueError, match="not an sdopt report"):
        Report.from_dict({"hello": 1})
    with pytest.raises(ValueError, match="not an sdopt report"):
        Report.from_dict({"sdopt_report": 1, "device": "cpu", "torch": "x"})


def test_markdown_adds_dynamic_vram_beside_the_allocator_peak(report):
    report.runs[1]["peak_outside_allocator_bytes"] = 1536 * 2**20
    lines = report.markdown().splitlines()
    fp16, baseline = ([line for line in lines if line.startswith(f"| {label} ") and "(RAM)" in line] for label in ("fp16", "baseline"))
    assert len(fp16) == 1 and fp16[0].split(" | ")[-2].endswith("(RAM) + 1,536.0 dynamic VRAM"), "the memory cell"
    assert len(baseline) == 1 and "dynamic VRAM" not in baseline[0]
    report.nodes[0]["peak_outside_allocator_bytes"] = 512 * 2**20
    assert "| 3 | KSampler | 1.500 | 10.0 + 512.0 dynamic VRAM |" in report.markdown()


def _warmed_up_run(label: str, seconds: list[float], warmup: dict[int, dict[str, float]]) -> dict:
    """A run's dict as the profiler files it, with ``warmup`` ({step: {kind: seconds}}) marked."""
    run = SamplingRun(label, "cpu")
    with run.memory_scope():
        run.start()
        for index in range(len(seconds)):
            for kind, spent in warmup.get(index, {}).items():
                run.warm_up(kind, spent)
            run.step()
        run.finish()
    data = run.result().to_dict()
    for step, spent in zip(data["steps"], seconds):
        step["seconds"] = spent
    data["first_step_s"], data["steady_it_per_s"] = seconds[0], steady_it_per_s(seconds, warmup)
    return data


def test_markdown_shows_warm_up_steps_apart_from_the_steady_rate():
    steady = _warmed_up_run("compiled", [0.5, 12.0, 0.25, 0.25], {1: {"compile": 11.5}})
    first_only = _warmed_up_run("two steps", [0.5, 12.0], {1: {"compile": 11.5}})
    none_left = _warmed_up_run("graphed", [3.0], {0: {"compile": 2.0, "capture": 0.5}})
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in Report(device="cpu", runs=[steady, first_only, none_left]).markdown().splitlines()}
    assert rows["run"][3:5] == ["steady it/s", "warm-up steps"]
    assert rows["compiled"][3:5] == ["4.00", "1: compile 11.5 s"]
    assert rows["two steps"][3:5] == ["2.00 (first step only)", "1: compile 11.5 s"]
    assert none_left["steady_it_per_s"] is None and rows["graphed"][3:5] == ["-", "0: compile 2.0 s, capture 0.5 s"]


def test_chart_marks_warm_up_steps(tmp_path):
    runs = [_warmed_up_run("compiled", [0.5, 12.0, 0.25, 0.25], {1: {"compile": 11.5}})]
    path = Report(device="cpu", runs=runs).save_chart(tmp_path / "warm.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
