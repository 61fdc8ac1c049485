"""sdopt under ComfyUI 0.38's dynamic VRAM on a real GPU, with the bundle of tools/gpu-bundle-dynamic.sh
(a ComfyUI that offers it, comfy-aimdo installed); skipped, with the reason, elsewhere.

The headless host starts dynamic VRAM as ComfyUI's server does (``--memory-mode auto``). Then
workflows/sd15_fast.json (Precision, Attention, Compile and CUDA Graph; Precision's private copy is a
non-dynamic patcher, which the last two compile and capture) runs on the full SD1.5 checkpoint at 512², its image within bench speed's
tolerance of its eager twin's (the same workflow with Compile and CUDA Graph bypassed) under the same
memory mode, and its report names dynamic VRAM and the memory it mapped past PyTorch's allocator.
The same workflow runs stock first, as a user adds sdopt to a workflow they ran: the cached model's
layers then hold aimdo's views of their VRAM window, which Precision's private copy must leave behind.
"""
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdopt.tools.bench_speed import IMAGE_TOLERANCE

WORKFLOWS = Path(__file__).resolve().parents[3] / "workflows"
BYPASSED = 4  # a node's mode when the user bypasses it
SDOPT_NODES = ("SDOptPrecision", "SDOptAttention", "SDOptProfiler", "SDOptVAEPrecision", "SDOptVAEAttention", "SDOptCompile",
               "SDOptCUDAGraph", "SDOptProfileReport")
FULL_512 = ["CheckpointLoaderSimple.ckpt_name=sdopt-full-sd15.safetensors", "EmptyLatentImage.width=512",
            "EmptyLatentImage.height=512", "KSampler.steps=8"]


@pytest.fixture(scope="module")
def host():
    comfyui = os.environ.get("COMFYUI_PATH")
    if not comfyui:
        pytest.skip("inside ComfyUI: set COMFYUI_PATH")
    if "def enables_dynamic_vram" not in (Path(comfyui) / "comfy" / "cli_args.py").read_text():
        pytest.skip("this ComfyUI has no dynamic VRAM: carry the bundle of tools/gpu-bundle-dynamic.sh")
    if importlib.util.find_spec("comfy_aimdo") is None:
        pytest.skip("comfy-aimdo is not installed: carry the bundle of tools/gpu-bundle-dynamic.sh")
    from sdopt.tools.headless import boot

    return boot(comfyui)


def _run(host, bypass=()):
    """sd15_fast on the full checkpoint at 512², with the nodes of ``bypass`` bypassed (Ctrl+B)."""
    from sdopt.tools.workflow import load_workflow

    workflow = load_workflow(WORKFLOWS / "sd15_fast.json")
    for node in workflow["nodes"]:
        if node["type"] in bypass:
            node["mode"] = BYPASSED
    outcome = host.execute(host.prompt_from(workflow, FULL_512))
    (image,) = [path for path in outcome.images if path.name.startswith("fast")]
    return outcome, np.asarray(Image.open(image), dtype=np.float64)


def test_dynamic_vram_starts_as_a_server_starts_it(host):
    assert host.memory_mode.dynamic is True, host.memory_mode.why


def test_fast_path_runs_compiled_and_graphed_within_tolerance_of_its_eager_twin(host):
    import torch

    stock, _ = _run(host, bypass=SDOPT_NODES)
    assert stock.report is None
    after_stock = torch.cuda.memory_allocated()
    eager, reference = _run(host, bypass=("SDOptCompile", "SDOptCUDAGraph"))
    print(f"\nallocated after the stock run {after_stock / 2**20:.0f} MiB, after the eager twin "
          f"{torch.cuda.memory_allocated() / 2**20:.0f} MiB")
    fast, image = _run(host)
    levels = np.abs(image - reference)
    print(f"\nfast path against its eager twin under dynamic VRAM: max {levels.max():.1f}, mean {levels.mean():.2f} levels")
    print(fast.report.markdown())
    assert IMAGE_TOLERANCE.admits(float(levels.max()), float(levels.mean()))
    for outcome in (eager, fast):
        assert outcome.report.memory_mode == "dynamic VRAM"
    (run,) = fast.report.runs
    records = {record["node"]: record for record in run["optimizations"]}
    for node in ("SDOptCompile", "SDOptCUDAGraph"):
        assert records[node]["active"] != "eager", records[node]
    assert run.get("peak_outside_allocator_bytes") is not None, "the profiler probes what aimdo maps"
