"""SDOptLowMemory in real ComfyUI on the mini checkpoint: the sampled latent equals stock's to float
rounding (the 1e-5 relative tolerance of the attention backends) and the model it was given is
unchanged. At 64x64 only sequential CFG and sub-quadratic attention cut in, even at a 1 MiB budget;
the chunked ops themselves are held equal to the unchunked ones in tests/unit/optim/test_lowmem.py."""
import torch

REL_TOL = 1e-5


def test_low_memory_sampling_matches_stock_and_leaves_the_model_alone(comfy_host):
    model = comfy_host.load_checkpoint()[0]
    stock = comfy_host.sample(model)
    (patched,) = comfy_host.nodes["SDOptLowMemory"]().patch(model, 1, True, True)
    out = comfy_host.sample(patched)
    assert (out - stock).abs().max().item() <= REL_TOL * stock.abs().max().item()
    assert torch.equal(comfy_host.sample(model), stock)
    records = {r["node"]: r for r in comfy_host.glue.model_records(patched.model_options)}
    assert records["SDOptLowMemory"]["active"] == "budget 1 MiB, sub_quadratic attention, sequential cfg, chunked GroupNorm/conv/feed-forward"
    assert records["SDOptAttention"]["active"] == "sub_quadratic"
