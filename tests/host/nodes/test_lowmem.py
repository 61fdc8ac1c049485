"""SDOptLowMemory in real ComfyUI on each family's mini checkpoint: the sampled latent equals stock's
to float rounding (the 1e-5 relative tolerance of the attention backends) and the model it was
given is unchanged. At 64x64 and a 1 MiB budget, sequential CFG and sub-quadratic attention cut
in, on SDXL through its 2- and 10-block transformers, with each half of the CFG batch given its own
rows of the ``y`` vector; so does the feed-forward slicing where a GEGLU (2560 wide) meets 64
tokens, as on SD1.5's first level (SDXL's transformers start a level lower, at 16 tokens). The
chunked GroupNorm and convs are held equal to the unchunked ones in tests/unit/optim/test_lowmem.py."""
import contextlib

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

REL_TOL = 1e-5


def close(out, reference):
    return (out - reference).abs().max().item() <= REL_TOL * reference.abs().max().item()


@contextlib.contextmanager
def feedforward_tokens():
    """The token counts every FeedForward module is called with (its input's second-to-last dim):
    a sliced module is called with all its tokens, then with each slice."""
    seen = []

    def hook(module, args):
        if type(module).__name__ == "FeedForward" and args[0].shape[-2]:
            seen.append(args[0].shape[-2])

    handle = register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _diffusion_inputs_spy(seen: list):
    """DIFFUSION_MODEL wrapper: the batch of x, context and y of every call."""

    def spy(executor, x, timesteps, context, y=None, *args, **kwargs):
        seen.append((x.shape[0], context.shape[0], None if y is None else y.shape[0]))
        return executor(x, timesteps, context, y, *args, **kwargs)

    return spy


def test_low_memory_sampling_matches_stock_and_leaves_the_model_alone(family_host):
    import comfy.patcher_extension

    model = family_host.load_checkpoint()[0]
    with feedforward_tokens() as stock_tokens:
        stock = family_host.sample(model)
    (patched,) = family_host.nodes["SDOptLowMemory"]().patch(model, 1, True, True)
    spied, calls = patched.clone(), []
    spied.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test.spy", _diffusion_inputs_spy(calls))
    with feedforward_tokens() as tokens:
        out = family_host.sample(spied)
    assert close(out, stock), family_host.model_family.title
    assert torch.equal(family_host.sample(model), stock), "the model the node was given is unchanged"
    has_y = family_host.model_family.call.vector is not None
    assert calls and all(call == (1, 1, 1 if has_y else None) for call in calls), "cond and uncond one at a time, y split with them"
    over_budget = 2 * 2560 * max(stock_tokens) * 4 > 2**20  # GEGLU activations of the widest feed-forward, fp32
    assert (set(tokens) != set(stock_tokens)) == over_budget, "feed-forwards over the budget ran over token slices too"
    records = {r["node"]: r for r in family_host.glue.model_records(patched.model_options)}
    assert records["SDOptLowMemory"]["active"] == "budget 1 MiB, low_memory attention, sequential cfg, chunked GroupNorm/conv/feed-forward"
    assert "family unknown" not in records["SDOptLowMemory"]["note"]
    assert records["SDOptAttention"]["active"] == "sdpa_fused (sub_quadratic for inputs no fused kernel takes)"


def test_chunked_ops_on_the_whole_cfg_batch_match_stock(family_host):
    model = family_host.load_checkpoint()[0]
    stock = family_host.sample(model)
    (patched,) = family_host.nodes["SDOptLowMemory"]().patch(model, 1, False, True)
    assert close(family_host.sample(patched), stock), family_host.model_family.title


def test_a_lora_after_and_before_the_node_is_used_at_each_strength(family_host):
    """After: a LoRA loader downstream of the node, its strength changed. Before: upstream, so the node
    runs again on each new model, as ComfyUI re-runs it when the strength changes."""
    model = family_host.load_checkpoint()[0]
    stock = family_host.sample(model)
    lora, node = family_host.lora(), family_host.nodes["SDOptLowMemory"]()
    (patched,) = node.patch(model, 1, True, True)
    for strength in (1.0, 0.5, 1.0):
        eager = family_host.sample(family_host.with_lora(model, lora, strength))
        assert not close(eager, stock), "the test LoRA must change the output"
        after = family_host.sample(family_host.with_lora(patched, lora, strength))
        assert close(after, eager), f"LoRA after the node, strength {strength}"
        (before,) = node.patch(family_host.with_lora(model, lora, strength), 1, True, True)
        assert close(family_host.sample(before), eager), f"LoRA before the node, strength {strength}"
    assert torch.equal(family_host.sample(model), stock), "the model the node was given is unchanged"
