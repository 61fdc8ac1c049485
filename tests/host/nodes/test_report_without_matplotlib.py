"""The pack without matplotlib (an optional dependency): the baseline workflow runs to the end
through the CLI, prints its table, and the report says why it has no chart."""
import json
import os
import subprocess
import sys

# ``sys.modules[name] = None`` is what an uninstalled package looks like to both ``import`` and
# ``importlib.util.find_spec``; the CLI then runs in this interpreter as ``sdopt run`` would.
WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from sdopt.tools.cli import main; sys.exit(main(sys.argv[1:]))"
)
CHART_MISSING = "matplotlib is not installed (pip install matplotlib)"


def test_baseline_runs_to_the_end_without_matplotlib(comfy_host, tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable, "-c", WITHOUT_MATPLOTLIB, "run", str(comfy_host.WORKFLOWS / "sd15_baseline.json"),
        "--comfyui", str(comfy_host.host.path), "--models", str(comfy_host.models),
        "--set", "KSampler.steps=1", "--set", "EmptyLatentImage.width=64", "--set", "EmptyLatentImage.height=64",
        "--out", str(out),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]

    assert "| baseline | 1 |" in done.stdout, done.stdout
    assert CHART_MISSING in done.stdout, "the printed table carries the note"
    (report_line,) = [line for line in done.stdout.splitlines() if line.startswith("report: ")]
    report = json.loads(open(report_line.removeprefix("report: ")).read())
    assert any(CHART_MISSING in note for note in report["notes"]), report["notes"]
    (run,) = report["runs"]
    assert len(run["steps"]) == 1

    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert [p for p in pngs if "profile" in p] == [], "no chart is written"
    assert [p for p in pngs if "baseline" in p], "the workflow's own image is saved"
