"""SDOptOffload on a real GPU, inside ComfyUI: weights resident and peak VRAM per mode at 512² on
the full SD1.5 checkpoint (fp16), and each mode's latent against the fully resident one.

Streamed layers run the same kernels on weights copied per layer, so the latents match to the
run-to-run noise of cuDNN's algorithm choice (1e-3). Printed figures (``pytest -s``) go into
docs/benchmarks.md with the device name.
"""

import torch

MIB = 2**20
BUDGET_MB = 512
LATENT_ATOL = 1e-3


def test_each_mode_keeps_its_residency_and_lowers_the_peak(comfy):
    import comfy.model_management as mm
    import nodes

    host, model, positive, negative = comfy
    latent = {"samples": torch.zeros(1, 4, 64, 64)}
    offload = host.node_classes["SDOptOffload"]()
    figures = {}
    for mode in ("none", "budget", "sequential"):
        (patched,) = offload.patch(model, mode, BUDGET_MB, "error")
        mm.unload_all_models()
        mm.soft_empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = nodes.common_ksampler(patched, 42, 4, 7.0, "euler", "normal", positive, negative, latent)[0]["samples"]
        figures[mode] = (patched.loaded_size(), torch.cuda.max_memory_allocated() - before, out)
    print(f"\n{torch.cuda.get_device_name()}: SD1.5 512², 4 steps, CFG 7, fp16")
    for mode, (resident, peak, _) in figures.items():
        print(f"  {mode:10s} resident {resident / MIB:8,.1f} MiB   peak {peak / MIB:8,.1f} MiB")
    size = model.model_size()
    assert figures["none"][0] == size
    assert 0 < figures["budget"][0] <= BUDGET_MB * MIB
    assert figures["sequential"][0] < 0.01 * size
    assert figures["sequential"][1] < figures["none"][1]
    for mode in ("budget", "sequential"):
        torch.testing.assert_close(figures[mode][2], figures["none"][2], rtol=0, atol=LATENT_ATOL)
