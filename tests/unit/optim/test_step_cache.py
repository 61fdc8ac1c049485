"""optim.step_cache: the config, the schedule of full and reused calls, the UNet split, and First Block Cache."""
import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.optim.step_cache import (
    BYPASSED, CHANGED, FIRST_BLOCK, FIRST_CALL, INTERVAL_DUE, NEW_SHAPE, OUTSIDE_SPAN, CacheSchedule, FirstBlockCache, StepCacheConfig,
    full_forward, shallow_forward, unavailable,
)

SHAPES = ((2, 4, 8, 8),)


@pytest.mark.parametrize("options, problem", [
    ({"mode": "teacache"}, "mode: 'teacache'"),
    ({"interval": 0}, "interval: 0 must be at least 1"),
    ({"branch": -1}, "branch: -1"),
    ({"start": 0.6, "end": 0.5}, "need 0 <= start < end <= 1"),
])
def test_bad_settings_name_the_input(options, problem):
    with pytest.raises(UserError, match=problem):
        StepCacheConfig(**options)


def test_every_interval_th_call_runs_the_whole_unet():
    schedule = CacheSchedule(StepCacheConfig(interval=3))
    schedule.reset()
    pattern = []
    for call in range(7):
        kept = schedule.decide("cond", SHAPES)
        pattern.append("reuse" if kept is not None else "full")
        if kept is None:
            schedule.keep("cond", SHAPES, torch.full((1,), float(call)))
        else:
            assert kept.item() == 3 * (call // 3), "the features of the last full call"
    assert pattern == ["full", "reuse", "reuse", "full", "reuse", "reuse", "full"]
    assert schedule.stats.full_reasons == {FIRST_CALL: 1, INTERVAL_DUE: 2}
    assert schedule.stats.summary() == "3 of 7 calls ran the whole UNet, 4 reused deep features"


def test_interval_one_reuses_nothing_as_asked_and_a_larger_one_says_when_it_reused_nothing():
    for interval, calls, shortfall in ((1, 3, ""), (3, 1, "reused nothing: first call of its shapes in this run (1x)")):
        config = StepCacheConfig(interval=interval)
        schedule = CacheSchedule(config)
        for _ in range(calls):
            if schedule.decide("k", SHAPES) is None:
                schedule.keep("k", SHAPES, torch.zeros(1))
        assert schedule.stats.reused_calls == 0 and config.reuses_nothing == (interval == 1)
        assert schedule.stats.shortfall() == shortfall, "settings that ask for no reuse fall short of nothing"
        schedule.reset()
        assert schedule.stats.asked_to_reuse == (interval != 1), "a new run keeps what the settings ask"


def test_each_key_keeps_its_own_features_as_sequential_cfg_and_multi_call_samplers_need():
    schedule = CacheSchedule(StepCacheConfig(interval=2))
    for key in ("cond", "uncond"):
        assert schedule.decide(key, SHAPES) is None
        schedule.keep(key, SHAPES, torch.tensor([1.0 if key == "cond" else -1.0]))
    assert schedule.decide("cond", SHAPES).item() == 1.0 and schedule.decide("uncond", SHAPES).item() == -1.0


def test_new_shapes_and_a_new_run_start_afresh():
    schedule = CacheSchedule(StepCacheConfig(interval=4))
    schedule.decide("k", SHAPES)
    schedule.keep("k", SHAPES, torch.zeros(1))
    assert schedule.decide("k", ((1, 4, 8, 8),)) is None
    assert schedule.stats.full_reasons[NEW_SHAPE] == 1
    schedule.keep("k", SHAPES, torch.zeros(1))
    schedule.reset()
    assert schedule.decide("k", SHAPES) is None, "weights may have changed between runs (a LoRA's strength)"
    assert schedule.stats.full_reasons == {FIRST_CALL: 1}, "stats are the current run's"
    schedule.keep("k", SHAPES, torch.zeros(1))
    schedule.release()
    assert schedule.stats.full_reasons == {FIRST_CALL: 1}, "a finished run's features go, its stats stay for the record"
    assert schedule.decide("k", SHAPES) is None and schedule.stats.full_reasons == {FIRST_CALL: 2}


def test_calls_outside_the_span_run_the_whole_unet():
    schedule = CacheSchedule(StepCacheConfig(interval=10, start=0.25, end=0.75))
    decisions = []
    for position in (0.0, 0.1, 0.3, 0.5, 0.8, None):
        kept = schedule.decide("k", SHAPES, position)
        decisions.append(kept is not None)
        if kept is None:
            schedule.keep("k", SHAPES, torch.zeros(1))
    assert decisions == [False, False, True, True, False, False]
    assert schedule.stats.full_reasons[OUTSIDE_SPAN] == 4


class ToyUNet(nn.Module):
    """A UNet of ``depth`` levels in the step cache's terms: conv blocks, skip concatenation."""

    def __init__(self, depth=3, channels=4):
        super().__init__()
        torch.manual_seed(0)
        self.depth = depth
        self.time = nn.Linear(1, channels)
        self.downs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1, stride=1 if i == 0 else 2) for i in range(depth))
        self.mid = nn.Conv2d(channels, channels, 3, padding=1)
        self.ups = nn.ModuleList(nn.Conv2d(2 * channels, channels, 3, padding=1) for _ in range(depth))
        self.out = nn.Conv2d(channels, channels, 1)
        self.calls = []

    def embed(self, x, timesteps, y):
        return self.time(timesteps[:, None])[:, :, None, None]

    def down(self, index, h, emb, context):
        self.calls.append(("down", index))
        return torch.tanh(self.downs[index](h) + emb)

    def middle(self, h, emb, context):
        self.calls.append(("middle",))
        return torch.tanh(self.mid(h))

    def up(self, index, h, skip, emb, context, output_shape):
        self.calls.append(("up", index))
        if h.shape[-1] != skip.shape[-1]:
            h = nn.functional.interpolate(h, size=skip.shape[-2:])
        return torch.tanh(self.ups[index](torch.cat([h, skip], dim=1)))

    def head(self, h, x):
        return self.out(h)


@pytest.mark.parametrize("branch", [0, 1])
def test_the_shallow_call_on_its_own_calls_features_equals_the_full_call(branch):
    unet = ToyUNet()
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([0.5, 0.5])
    with torch.no_grad():
        full, deep = full_forward(unet, branch, x, t, None)
        unet.calls.clear()
        shallow = shallow_forward(unet, branch, x, t, None, deep=deep)
    assert torch.equal(shallow, full)
    assert unet.calls == [*(("down", i) for i in range(branch + 1)), *(("up", i) for i in range(unet.depth - 1 - branch, unet.depth))]


def test_a_branch_past_the_levels_is_unavailable():
    assert unavailable(StepCacheConfig(branch=2), None, blocks=ToyUNet(depth=3)) is None
    reason, fix, input_name = unavailable(StepCacheConfig(branch=3), None, blocks=ToyUNet(depth=3))
    assert "past the UNet's 3 skip levels" in reason and (fix, input_name) == ("choose a branch below 3", "branch")
    problem = unavailable(StepCacheConfig(), None, blocks=None)
    assert "not a UNet" in problem.reason and problem.input == "mode"


class ToyTransformer(nn.Module):
    """Flux's shape of forward: double blocks on (img, txt), the last dropping txt where
    ``drop_txt``, then single blocks on txt and img joined along the tokens."""

    def __init__(self, doubles: int, singles: int, width: int = 8, drop_txt: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.img = nn.ModuleList(nn.Linear(width, width) for _ in range(doubles))
        self.txt = nn.ModuleList(nn.Linear(width, width) for _ in range(doubles))
        self.single = nn.ModuleList(nn.Linear(width, width) for _ in range(singles))
        self.drop_txt = drop_txt

    @property
    def groups(self):
        return (("double_block", len(self.img)), ("single_block", len(self.single)))

    def double(self, i, args):
        txt = None if self.drop_txt and i == len(self.img) - 1 else args["txt"] + torch.tanh(self.txt[i](args["txt"]))
        return {"img": args["img"] + torch.tanh(self.img[i](args["img"] + args["txt"].mean(1, keepdim=True))), "txt": txt}

    def forward(self, img, txt, cache=None):
        run_block = (lambda group, i, args, run: run()) if cache is None else cache.block
        for i in range(len(self.img)):
            out = run_block("double_block", i, {"img": img, "txt": txt}, lambda: self.double(i, {"img": img, "txt": txt}))
            img, txt = out["img"], out["txt"] if out["txt"] is not None else txt
        joined = torch.cat((txt, img), 1)
        for i, block in enumerate(self.single):
            joined = run_block("single_block", i, {"img": joined}, lambda: {"img": joined + torch.tanh(block(joined))})["img"]
        return joined[:, txt.shape[1]:]


def _toy_call(model, cache, img, txt, key="cond", position=None, bypass=None):
    cache.begin(key, (img.shape, txt.shape), position, bypass)
    return model(img, txt, cache)


@pytest.mark.parametrize("doubles, singles, drop_txt", [(3, 4, False), (1, 1, False), (2, 3, True)])
def test_first_block_cache_skips_an_unchanged_call_and_gives_the_full_output(doubles, singles, drop_txt):
    model = ToyTransformer(doubles, singles, drop_txt=drop_txt)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.05), model.groups, "img")
    img, txt = torch.randn(2, 6, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        plain = model(img, txt)
        first = _toy_call(model, cache, img, txt)
        again = _toy_call(model, cache, img, txt)
    assert torch.equal(first, plain), "a full call is the plain forward"
    torch.testing.assert_close(again, plain, rtol=0, atol=1e-6)  # first block's output + the kept changes: rounding only
    assert (cache.stats.full_calls, cache.stats.reused_calls) == (1, 1)
    assert cache.stats.full_reasons == {FIRST_CALL: 1}
    assert cache.stats.summary() == "1 of 2 calls ran every block, 1 skipped the blocks after the first"


def test_first_block_cache_decides_each_pass_over_the_blocks_afresh():
    """A host that runs the blocks twice in one call (each half of a batch in turn) must not have the
    second pass start in the first pass's skipping state."""
    model = ToyTransformer(3, 4)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.05), model.groups, "img")
    img, txt = torch.randn(2, 6, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        plain = model(img, txt)
        _toy_call(model, cache, img, txt)
        _toy_call(model, cache, img, txt)  # skips
        again = model(img * 3, txt, cache)  # a second pass in the same call
    assert torch.isfinite(again).all() and cache.stats.full_calls == 2, "a changed first block runs every block"
    torch.testing.assert_close(again, model(img * 3, txt), rtol=0, atol=0)
    assert not torch.equal(again, plain)


def test_first_block_cache_skipped_blocks_do_not_run():
    model = ToyTransformer(3, 4)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.05), model.groups, "img")
    img, txt = torch.randn(2, 6, 8), torch.randn(2, 3, 8)
    ran = []
    for name, blocks in (("img", model.img), ("single", model.single)):
        for i, block in enumerate(blocks):
            block.register_forward_hook(lambda *_, name=name, i=i: ran.append((name, i)))
    with torch.no_grad():
        _toy_call(model, cache, img, txt)
        ran.clear()
        _toy_call(model, cache, img, txt)
    assert ran == [("img", 0)]


def test_first_block_cache_runs_every_block_where_the_first_block_changed_more_than_the_threshold():
    model = ToyTransformer(3, 2)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.05), model.groups, "img")
    img, txt = torch.randn(2, 6, 8), torch.randn(2, 3, 8)
    other = torch.randn(2, 6, 8)
    with torch.no_grad():
        _toy_call(model, cache, img, txt)
        out = _toy_call(model, cache, other, txt)
        assert torch.equal(out, model(other, txt))
        near = _toy_call(model, cache, other * 1.001, txt)  # within the threshold of the last full call
    assert cache.stats.full_reasons == {FIRST_CALL: 1, CHANGED: 1} and cache.stats.reused_calls == 1
    torch.testing.assert_close(near, model(other * 1.001, txt), rtol=0, atol=0.05)


def test_first_block_cache_threshold_zero_never_skips():
    model = ToyTransformer(2, 2)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.0), model.groups, "img")
    img, txt = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with torch.no_grad():
        outs = [_toy_call(model, cache, img, txt) for _ in range(3)]
    assert all(torch.equal(out, model(img, txt)) for out in outs)
    assert cache.stats.reused_calls == 0 and cache.stats.shortfall() == "", "threshold 0 asks for no reuse"
    cache.reset()
    assert not cache.stats.asked_to_reuse and StepCacheConfig(mode=FIRST_BLOCK, threshold=0.08).reuses_nothing is False


def test_first_block_cache_keys_shapes_span_bypass_and_reset():
    model = ToyTransformer(2, 2)
    cache = FirstBlockCache(StepCacheConfig(mode=FIRST_BLOCK, threshold=0.5, start=0.2, end=0.8), model.groups, "img")
    img, txt = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with torch.no_grad():
        _toy_call(model, cache, img, txt, position=0.5)
        _toy_call(model, cache, img, txt, key="uncond", position=0.5)  # its own first call
        _toy_call(model, cache, img, txt, position=0.9)  # outside the span
        _toy_call(model, cache, torch.randn(1, 6, 8), txt, position=0.5)  # new shapes
        _toy_call(model, cache, img, txt, key="uncond", position=0.5)  # reuses uncond's
        _toy_call(model, cache, img, txt, key="uncond", position=0.5, bypass="ControlNet")
        _toy_call(model, cache, img, txt, key="uncond", position=0.5)  # the bypass left nothing to reuse
    assert cache.stats.full_reasons == {FIRST_CALL: 3, OUTSIDE_SPAN: 1, NEW_SHAPE: 1, BYPASSED + " (ControlNet)": 1}
    assert cache.stats.reused_calls == 1
    cache.reset()
    assert cache.stats.summary() == "no model calls yet"
    with torch.no_grad():
        _toy_call(model, cache, img, txt, key="uncond", position=0.5)
    assert cache.stats.full_reasons == {FIRST_CALL: 1}, "a new run reuses nothing from the last"


def test_first_block_unavailable_names_the_mode_that_fits():
    config = StepCacheConfig(mode=FIRST_BLOCK)
    assert unavailable(config, None, blocks=None, block_groups=(("double_block", 4),)) is None
    problem = unavailable(config, None, blocks=object(), block_groups=())
    assert problem.input == "mode" and problem.fix == "use mode deepcache"
    problem = unavailable(StepCacheConfig(), None, blocks=None, block_groups=(("double_block", 4),))
    assert problem.fix == "use mode first_block"
    with pytest.raises(UserError, match="threshold: 1.5"):
        StepCacheConfig(mode=FIRST_BLOCK, threshold=1.5)
