"""SDOptLowMemory in real ComfyUI on each family's mini checkpoint: the sampled latent equals stock's
to float rounding (the 1e-5 relative tolerance of the attention backends) and the model it was
given is unchanged. At 64x64 and a 1 MiB budget, sequential CFG and sub-quadratic attention cut
in, on SDXL through its 2- and 10-block transformers, with each half of the CFG batch given its own
rows of the ``y`` vector (SD3.5 and Flux too: their pooled text); so does the feed-forward slicing
wherever a feed-forward's hidden activations pass the budget (SD1.5's first-level GEGLU, 2560 wide
at 64 tokens; Flux's 12288-wide image and text MLPs; the SD3.5 mini's 1536-wide MLPs stay under it). The chunked GroupNorm and convs
are held equal to the unchunked ones in tests/unit/optim/test_lowmem.py."""
import contextlib
import functools

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from sdopt.optim.lowmem import feedforward_working_bytes

REL_TOL = 1e-5
BUDGET = 2**20


def close(out, reference):
    return (out - reference).abs().max().item() <= REL_TOL * reference.abs().max().item()


@contextlib.contextmanager
def feedforward_tokens(host, model):
    """(tokens, working bytes) of every call of the family's feed-forward modules (by class, or by
    attribute name in ``model``'s diffusion model): a sliced module is called with all its tokens,
    then with each slice."""
    seen = []
    names = set(host.model_family.feedforward_modules)
    named = {id(m) for key, m in model.model.diffusion_model.named_modules() if key.rpartition(".")[2] in names}

    def hook(module, args):
        if (type(module).__name__ in names or id(module) in named) and args[0].shape[-2]:
            seen.append((args[0].shape[-2], feedforward_working_bytes(module, args[0])))

    handle = register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _diffusion_inputs_spy(seen: list):
    """APPLY_MODEL wrapper (inside Low Memory's): the batch of x, context and y of every call."""

    def spy(executor, x, t, c_concat=None, c_crossattn=None, *args, **kwargs):
        y = kwargs.get("y")
        seen.append((x.shape[0], c_crossattn.shape[0], None if y is None else y.shape[0]))
        return executor(x, t, c_concat, c_crossattn, *args, **kwargs)

    return spy


def test_low_memory_sampling_matches_stock_and_leaves_the_model_alone(family_host):
    import comfy.patcher_extension

    model = family_host.load_checkpoint()[0]
    with feedforward_tokens(family_host, model) as stock_calls:
        stock = family_host.sample(model)
    (patched,) = family_host.nodes["SDOptLowMemory"]().patch(model, 1, True, True)
    spied, calls = patched.clone(), []
    spied.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "test.spy", _diffusion_inputs_spy(calls))
    with feedforward_tokens(family_host, model) as sliced_calls:
        out = family_host.sample(spied)
    assert close(out, stock), family_host.model_family.title
    assert torch.equal(family_host.sample(model), stock), "the model the node was given is unchanged"
    has_y = family_host.model_family.call.vector is not None
    assert calls and all(call == (1, 1, 1 if has_y else None) for call in calls), "cond and uncond one at a time, y split with them"
    # CFG halves: each feed-forward sees half the stock batch's bytes
    over_budget = max(working for _, working in stock_calls) / 2 > BUDGET
    tokens, stock_tokens = {t for t, _ in sliced_calls}, {t for t, _ in stock_calls}
    assert (tokens != stock_tokens) == over_budget, "feed-forwards over the budget ran over token slices too"
    records = {r["node"]: r for r in family_host.patching.model_records(patched.model_options)}
    active = records["SDOptLowMemory"]["active"]
    assert active.startswith("budget 1 MiB, low_memory attention, sequential cfg, chunked over the budget: ")
    assert "feed-forwards" in active and not records["SDOptLowMemory"]["short"]
    assert "family unknown" not in records["SDOptLowMemory"]["note"]
    if family_host.model_family.name in ("sd35", "flux"):
        assert "diffusion model has no GroupNorms" in records["SDOptLowMemory"]["note"]
    assert records["SDOptAttention"]["active"] == "sdpa_fused (sub_quadratic for inputs no fused kernel takes)"


def test_chunked_ops_on_the_whole_cfg_batch_match_stock(family_host):
    model = family_host.load_checkpoint()[0]
    stock = family_host.sample(model)
    (patched,) = family_host.nodes["SDOptLowMemory"]().patch(model, 1, False, True)
    assert close(family_host.sample(patched), stock), family_host.model_family.title


def test_a_lora_after_and_before_the_node_is_used_at_each_strength(lean_host):
    """After: a LoRA loader downstream of the node, its strength changed. Before: upstream, so the node
    runs again on each new model, as ComfyUI re-runs it when the strength changes."""
    model = lean_host.load_checkpoint()[0]
    stock = lean_host.sample(model)
    lora, node = lean_host.lora(), lean_host.nodes["SDOptLowMemory"]()
    (patched,) = node.patch(model, 1, True, True)
    eager_at = functools.cache(lambda strength: lean_host.sample(lean_host.with_lora(model, lora, strength)))
    for strength in (1.0, 0.5, 1.0):
        eager = eager_at(strength)
        assert not close(eager, stock), "the test LoRA must change the output"
        after = lean_host.sample(lean_host.with_lora(patched, lora, strength))
        assert close(after, eager), f"LoRA after the node, strength {strength}"
        (before,) = node.patch(lean_host.with_lora(model, lora, strength), 1, True, True)
        assert close(lean_host.sample(before), eager), f"LoRA before the node, strength {strength}"
    assert torch.equal(lean_host.sample(model), stock), "the model the node was given is unchanged"
