"""optim.step_cache: the config, the schedule of full and reused calls, and the UNet split."""
import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.optim.step_cache import (
    FIRST_CALL, INTERVAL_DUE, NEW_SHAPE, OUTSIDE_SPAN, CacheSchedule, StepCacheConfig, full_forward, shallow_forward, unavailable,
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


def test_interval_one_reuses_nothing_and_says_so():
    schedule = CacheSchedule(StepCacheConfig(interval=1))
    for _ in range(3):
        if schedule.decide("k", SHAPES) is None:
            schedule.keep("k", SHAPES, torch.zeros(1))
    assert schedule.stats.reused_calls == 0
    assert schedule.stats.shortfall().startswith("reused nothing: first call of its shapes in this run (1x), interval due (2x)")


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
