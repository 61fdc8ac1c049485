"""sdopt doctor on a CUDA GPU: the CUDA rows really run (kernel, fp16/bf16, inductor with Triton, graph
capture), and the GPU-only nodes say they run here."""
import torch

from sdopt.nodes.checks import FAILED, OK, run_checks


def test_cuda_rows_run_on_the_gpu():
    rows = {r.check: r for r in run_checks("cuda")}
    failed = [f"{r.check}: {r.result}" for r in rows.values() if r.status == FAILED and not r.check.startswith("attention: ")]
    assert not failed, failed
    for check in ("device", "torch", "bf16 storage", "fp16 storage", "bf16 compute", "fp16 compute", "attention: sdpa",
                  "attention: sdpa_flash", "attention: sdpa_efficient", "inductor", "CUDA graph", "compile cache"):
        assert rows[check].status == OK, rows[check]
    assert torch.cuda.get_device_name() in rows["device"].result and "compute capability" in rows["device"].result
    assert "Triton" in rows["inductor"].result
    if torch.cuda.get_device_capability() >= (8, 9):
        assert rows["fp8 compute"].status == OK, rows["fp8 compute"]
    for node in ("sdopt CUDA Graph", "sdopt Offload", "sdopt Tiled VAE"):
        assert rows[f"node: {node}"].status == OK, rows[f"node: {node}"]
    assert "tf32" in rows["node: sdopt Precision"].result.split("cannot")[0]
    assert "auto → float16" in rows["node: sdopt Precision"].result
