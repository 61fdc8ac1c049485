"""SDOptStepCache in real ComfyUI, on the mini SD1.5 and SDXL checkpoints (CPU, fp32, 64x64, 6 steps)
with deepcache, and on the SD3.5 and Flux minis with first_block; each mode passes the other kind of
model through with the reason and the mode that fits, or refuses.

With interval 1 every call runs the step cache's own split of the UNet (``full_forward`` over
ComfyUI's blocks), which must give stock's latent exactly: the split calls ComfyUI's blocks in its
order. With DeepCache's defaults (interval 3) a third of the calls run the whole UNet; the image
differs from stock's (random weights: the size of that difference bounds nothing about trained
models), and the model the node was given is unchanged. Under Compile each kind of call (full,
shallow) compiles once, and a LoRA downstream is used at every strength.
"""
import functools

import pytest
import torch

from sdopt.optim.step_cache import FIRST_CALL

STEPS = 6
REL_TOL = 1e-4


def cached(host, model, interval=3, branch=0, start=0.0, end=1.0, on_unavailable="fallback"):
    (patched,) = host.nodes["SDOptStepCache"]().patch(model, "deepcache", interval, branch, start, end, on_unavailable)
    return patched


def schedule_stats(host, model):
    return host.fast_path.fast_path_of(model).state_of("SDOptStepCache").stats


def close(out, reference):
    return (out - reference).abs().max().item() <= REL_TOL * reference.abs().max().item()


@pytest.fixture(scope="module")
def stock_runs():
    """Per family, (model as loaded, its stock latent): sampled once in this module, and dropped with
    it rather than held until the interpreter exits."""
    return {}


def _stock(host, runs: dict):
    name = host.model_family.name
    if name not in runs:
        model = host.load_checkpoint()[0]
        runs[name] = model, host.sample(model, STEPS)
    return runs[name]


@pytest.fixture
def stock(unet_host, stock_runs):
    return _stock(unet_host, stock_runs)


@pytest.fixture
def sd15_stock(comfy_host, stock_runs):
    """The SD1.5 mini's: what does not depend on the family is held there only."""
    return _stock(comfy_host, stock_runs)


def test_interval_one_runs_the_split_unet_and_equals_stock(unet_host, stock):
    model, reference = stock
    patched = cached(unet_host, model, interval=1)
    assert torch.equal(unet_host.sample(patched, STEPS), reference)
    stats = schedule_stats(unet_host, patched)
    assert stats.reused_calls == 0 and stats.full_calls == STEPS


def test_deepcache_reuses_two_calls_in_three_and_leaves_the_model_alone(unet_host, stock):
    model, reference = stock
    patched = cached(unet_host, model)
    out = unet_host.sample(patched, STEPS)
    stats = schedule_stats(unet_host, patched)
    assert (stats.full_calls, stats.reused_calls) == (STEPS // 3, STEPS - STEPS // 3)
    assert torch.isfinite(out).all() and not torch.equal(out, reference), "reused features change the latent"
    assert "2 of 6 calls ran the whole UNet" in stats.summary()
    again = unet_host.sample(patched, STEPS)
    assert torch.equal(again, out), "a new sampling run starts from a fresh cache"
    assert torch.equal(unet_host.sample(model, STEPS), reference), "the model the node was given must be unchanged"


def sequential_cfg(host, model):
    """sdopt Low Memory with only its sequential cfg (no chunked ops): cond and uncond as calls of their own."""
    (patched,) = host.nodes["SDOptLowMemory"]().patch(model, 256, True, False)
    return patched


def test_deepcache_under_sequential_cfg_keeps_each_halfs_features_whichever_node_comes_first(unet_host, stock):
    """Low Memory runs cond and uncond one after the other, with equal shapes: each half must reuse its
    own deep features (before, the uncond half took the cond half's: 253 levels off at 64², 4 steps)."""
    model, _ = stock
    batched = unet_host.sample(cached(unet_host, model), STEPS)
    for patched in (sequential_cfg(unet_host, cached(unet_host, model)), cached(unet_host, sequential_cfg(unet_host, model))):
        out = unet_host.sample(patched, STEPS)
        assert close(out, batched), (out - batched).abs().max().item()
        stats = schedule_stats(unet_host, patched)
        assert (stats.full_calls, stats.reused_calls) == (2 * (STEPS // 3), 2 * (STEPS - STEPS // 3)), "each half on its own schedule"


def test_a_bounded_span_runs_the_whole_unet_outside_it(unet_host, stock):
    model, _ = stock
    patched = cached(unet_host, model, start=0.5)
    unet_host.sample(patched, STEPS)
    stats = schedule_stats(unet_host, patched)
    assert stats.full_reasons["outside the cached part of the schedule"] == STEPS // 2
    assert stats.reused_calls == 2, "the second half reuses the last full call's features until the interval is due"


def test_compiled_cache_compiles_each_kind_once_and_follows_a_lora(comfy_host, sd15_stock):
    model, _ = sd15_stock
    eager_cached = cached(comfy_host, model)
    (compiled,) = comfy_host.nodes["SDOptCompile"]().patch(cached(comfy_host, model), "trace", "inductor", "default", False, False, "fallback")
    assert close(comfy_host.sample(compiled, STEPS), comfy_host.sample(eager_cached, STEPS))
    lora = comfy_host.lora()
    expected_at = functools.cache(lambda strength: comfy_host.sample(comfy_host.with_lora(eager_cached, lora, strength), STEPS))
    for strength in (1.0, 0.5, 1.0):
        expected = expected_at(strength)
        assert close(comfy_host.sample(comfy_host.with_lora(compiled, lora, strength), STEPS), expected), f"strength {strength}"
    compile_stats = comfy_host.fast_path.fast_path_of(compiled).stats("SDOptCompile")
    assert sorted(s.compilations for s in compile_stats) == [1, 1], "one trace for the full call, one for the shallow call"


def test_a_branch_past_the_unets_levels_is_refused_or_passed_through(unet_host, stock):
    """Passed through: no step-cache wrapper and the record says why (an unwrapped model samples as
    stock does; that costs a minute of CI on SDXL and is held by every other test's stock model)."""
    model, _ = stock
    depth = len(model.model.diffusion_model.input_blocks)
    if depth > 11:
        pytest.skip(f"every branch the node offers fits this UNet's {depth} levels")
    with pytest.raises(Exception, match=f"branch: branch 11 is past the UNet's {depth} skip levels; choose a branch below {depth}"):
        cached(unet_host, model, branch=11, on_unavailable="error")
    passed = cached(unet_host, model, branch=11)
    assert unet_host.fast_path.fast_path_of(passed) is None and unet_host.wrapper_counts(passed, "SDOptStepCache") == {}
    (record,) = [r for r in unet_host.patching.model_records(passed.model_options) if r["node"] == "SDOptStepCache"]
    assert record["active"] == "eager" and f"branch 11 is past the UNet's {depth} skip levels" in record["note"]


def test_comfyuis_easycache_before_compile_runs_compiled_and_after_it_says_why_not(comfy_host, sd15_stock):
    if "EasyCache" not in comfy_host.nodes:
        pytest.skip("this ComfyUI has no EasyCache (it came with ComfyUI 0.3.50)")
    model, _ = sd15_stock
    host, compile_node = comfy_host, comfy_host.nodes["SDOptCompile"]()

    def easycache(m):
        return host.nodes["EasyCache"].execute(m, 0.2, 0.15, 0.95, False).result[0]

    def traced(m):
        return compile_node.patch(m, "trace", "inductor", "default", False, False, "fallback")[0]

    before = traced(easycache(model))
    assert close(host.sample(before, STEPS), host.sample(easycache(model), STEPS))
    fast = host.fast_path.fast_path_of(before)
    assert not fast.eager_reasons and [s.compilations for s in fast.stats("SDOptCompile")] == [1]
    after = easycache(traced(model))
    host.sample(after, STEPS)
    assert set(host.fast_path.fast_path_of(after).eager_reasons) == {"another DIFFUSION_MODEL wrapper runs inside this one"}


def test_comfyuis_easycache_under_sequential_cfg_sees_each_halfs_own_uuids(comfy_host, sd15_stock):
    """EasyCache splits a call's batch by ComfyUI's ``uuids``, one per conditioning: each half of Low
    Memory's split must list only its own (before, both halves listed both, and EasyCache took its rows
    at the wrong offsets: the latent moved by 16% of its range). Its skip decisions rest on statistics
    of the batch it is given, so its image under sequential CFG is not the batched one's, as when
    ComfyUI itself runs cond and uncond apart for lack of memory."""
    import comfy.patcher_extension

    if "EasyCache" not in comfy_host.nodes:
        pytest.skip("this ComfyUI has no EasyCache (it came with ComfyUI 0.3.50)")
    model, _ = sd15_stock
    seen = []

    def easycache(m):
        return comfy_host.nodes["EasyCache"].execute(m, 0.2, 0.15, 0.95, False).result[0]

    def spy(executor, *args, **kwargs):  # a DIFFUSION_MODEL wrapper inside EasyCache's: the call it saw
        options = args[-1] if isinstance(args[-1], dict) else kwargs["transformer_options"]
        seen.append((args[0].shape[0], len(options["uuids"])))
        return executor(*args, **kwargs)

    for patched in (sequential_cfg(comfy_host, easycache(model)), easycache(sequential_cfg(comfy_host, model))):
        spied, seen[:] = patched.clone(), []
        spied.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test.spy", spy)
        assert torch.isfinite(comfy_host.sample(spied, STEPS)).all()
        assert seen and set(seen) == {(1, 1)}, "one row and its one uuid per call"


def test_a_diffusion_transformer_is_passed_through_with_the_reason_or_refused(dit_host):
    model = dit_host.load_checkpoint()[0]
    with pytest.raises(Exception, match="mode: the model is not a UNet with down, middle and up blocks.*; use mode first_block"):
        cached(dit_host, model, on_unavailable="error")
    passed = cached(dit_host, model)
    assert dit_host.fast_path.fast_path_of(passed) is None
    (record,) = dit_host.patching.model_records(passed.model_options)
    assert record["active"] == "eager" and "not a UNet" in record["note"] and "not a UNet" in record["short"]
    assert torch.equal(dit_host.sample(passed), dit_host.sample(model))


def first_block(host, model, threshold=0.08, start=0.0, end=1.0, on_unavailable="fallback"):
    (patched,) = host.nodes["SDOptStepCache"]().patch(model, "first_block", 3, 0, start, end, on_unavailable, threshold)
    return patched


def block_cache(host, model):
    (cache,) = {host.fast_path.block_cache_of(patch) for patch in
                model.model_options["transformer_options"]["patches_replace"]["dit"].values()}
    return cache


def test_first_block_at_threshold_zero_runs_every_block_and_equals_stock(dit_host):
    """Every block goes through the cache's patch, and with nothing reused the latent is stock's."""
    model = dit_host.load_checkpoint()[0]
    reference = dit_host.sample(model)
    patched = first_block(dit_host, model, threshold=0.0)
    assert torch.equal(dit_host.sample(patched), reference)
    stats = block_cache(dit_host, patched).stats
    assert stats.reused_calls == 0 and stats.full_calls == 2, "2 steps, cond and uncond batched in each call"
    groups = dict(dit_host.pack("nodes.step_cache").block_groups(patched))
    assert set(patched.model_options["transformer_options"]["patches_replace"]["dit"]) == {
        (name, index) for name, count in groups.items() for index in range(count)}


def test_first_block_skips_the_later_blocks_and_leaves_the_model_alone(comfy_host, stock_runs):
    """On random weights the first block's change moves by about 100% from step to step (0.9 to 1.2
    on this mini; a trained model's moves by a few percent), so only the node's largest threshold
    skips here, and only on some calls."""
    host = comfy_host.family("sd35")
    model, reference = _stock(host, stock_runs)
    patched = first_block(host, model, threshold=1.0)
    out = host.sample(patched, STEPS)
    stats = block_cache(host, patched).stats
    assert stats.full_calls + stats.reused_calls == STEPS and stats.full_calls >= 1 and stats.reused_calls >= 1
    assert stats.summary() == f"{stats.full_calls} of {STEPS} calls ran every block, {stats.reused_calls} skipped the blocks after the first"
    assert torch.isfinite(out).all() and not torch.equal(out, reference), "skipped blocks change the latent"
    assert torch.equal(host.sample(patched, STEPS), out), "a new sampling run starts from a fresh cache"
    assert torch.equal(host.sample(model, STEPS), reference), "the model the node was given must be unchanged"
    (record,) = host.patching.model_records(patched.model_options)
    assert record["active"] == "first_block: threshold 1" and "6 double_blocks" in record["note"]


def test_first_block_under_sequential_cfg_decides_each_half_on_its_own_whichever_node_comes_first(comfy_host, stock_runs):
    host = comfy_host.family("sd35")
    model, _ = _stock(host, stock_runs)
    outs = []
    for patched in (sequential_cfg(host, first_block(host, model, threshold=1.0)),
                    first_block(host, sequential_cfg(host, model), threshold=1.0)):
        outs.append(host.sample(patched, STEPS))
        stats = block_cache(host, patched).stats
        assert stats.full_calls + stats.reused_calls == 2 * STEPS, "cond and uncond each a call of the cache's"
        assert stats.full_reasons[FIRST_CALL] == 2, "each half starts its own history"
    assert torch.equal(*outs), "Low Memory splits outside the cache's call, whatever the order"


def test_first_block_chained_twice_keeps_the_last_ones_settings(comfy_host, stock_runs):
    host = comfy_host.family("sd35")
    model, _ = _stock(host, stock_runs)
    twice = first_block(host, first_block(host, model, threshold=1.0), threshold=0.0)
    cache = block_cache(host, twice)
    assert cache.config.threshold == 0.0
    host.sample(twice)
    assert cache.stats.reused_calls == 0, "the first node's cache no longer runs inside the second's"


def test_first_block_under_regional_compile_runs_compiled_and_whole_compile_runs_eager(comfy_host, stock_runs):
    host = comfy_host.family("sd35")
    model, _ = _stock(host, stock_runs)
    compile_node = host.nodes["SDOptCompile"]()
    eager = host.sample(first_block(host, model, threshold=1.0), STEPS)

    regional = compile_node.patch(first_block(host, model, threshold=1.0), "compile_regional", "aot_eager", "default", False, False, "fallback")[0]
    assert close(host.sample(regional, STEPS), eager)
    fast = host.fast_path.fast_path_of(regional)
    assert not fast.eager_reasons and sum(s.compilations for s in fast.stats("SDOptCompile")) >= 1
    assert block_cache(host, regional).stats.reused_calls > 0

    whole = compile_node.patch(first_block(host, model, threshold=1.0), "trace", "inductor", "default", False, False, "fallback")[0]
    assert torch.equal(host.sample(whole, STEPS), eager), "the cache runs, eagerly"
    assert set(host.fast_path.fast_path_of(whole).eager_reasons) == {host.fast_path.FIRST_BLOCK_EAGER}


def test_first_block_on_a_unet_is_passed_through_with_the_mode_that_fits_or_refused(comfy_host, sd15_stock):
    model, reference = sd15_stock
    with pytest.raises(Exception, match="mode: the model is not a diffusion transformer.*; use mode deepcache"):
        first_block(comfy_host, model, on_unavailable="error")
    passed = first_block(comfy_host, model)
    (record,) = comfy_host.patching.model_records(passed.model_options)
    assert record["active"] == "uncached" and "not a diffusion transformer" in record["short"]
    assert "dit" not in passed.model_options["transformer_options"].get("patches_replace", {})
    assert torch.equal(comfy_host.sample(passed, STEPS), reference)
