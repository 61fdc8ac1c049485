"""The planner: sequential offload streams a UNet whose weights do not fit, budget offload keeps what the
budget leaves of it resident, and SD3.5's plans are bounded by its position grid."""
import pytest

from sdopt.measure.memory_model import PLANNER_TOLERANCE
from sdopt.tools.plan import SETTINGS, UNET_STEP, Planner, make_plan, plan_table

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def test_sequential_offload_streams_the_unet_when_its_weights_do_not_fit():
    planner = Planner("mini")
    predictions = [planner.predict(UNET_STEP, setting, 128, 128) for setting in SETTINGS[UNET_STEP]]
    budget = planner.streamed_unet_bytes + min(p.input_bytes + p.peak_bytes for p in predictions)
    assert 0 < planner.streamed_unet_bytes < planner.weights["unet"]
    assert planner.first_fitting(UNET_STEP, 128, 128, budget, "model") is None
    assert planner.first_fitting(UNET_STEP, 128, 128, budget, "sequential") is not None


def test_budget_offload_keeps_what_the_budget_leaves_of_the_unet_resident():
    planner = Planner("full")  # its UNet outweighs its text encoder, as in every real checkpoint
    budget = planner.weights["unet"] - 2**20
    plan = make_plan("full", 128, 128, budget, search=False)
    step = next(p for p in plan.chosen if p.stage == UNET_STEP)
    assert plan.offload == "budget", "the whole UNet does not fit, and streaming all of it would keep less than the budget allows"
    margin = int(step.peak_bytes * PLANNER_TOLERANCE)  # the planner's accuracy, left free beside the step
    assert plan.unet_resident_bytes == (budget - step.input_bytes - step.peak_bytes - margin) // 2**20 * 2**20
    assert planner.streamed_unet_bytes < plan.unet_resident_bytes < planner.weights["unet"]
    assert plan.total(step, "budget") <= budget
    assert f"mode budget, budget_mb {plan.unet_resident_bytes // 2**20}" in plan_table(plan)
    stock_step = planner.predict(UNET_STEP, SETTINGS[UNET_STEP][0], 512, 512)
    tight_budget = planner.streamed_unet_bytes + stock_step.input_bytes + int(stock_step.peak_bytes * (1 + PLANNER_TOLERANCE))
    tight = make_plan("full", 512, 512, tight_budget, search=False)
    assert tight.offload == "sequential", "a budget that leaves no more than the streamed layers is sequential offload"


def test_sd35_plan_is_bounded_by_its_position_grid(one_line_error):
    assert "--width: 128 px is over sd35-tiny's largest side, 64 px" in one_line_error(
        ["plan", "--model", "sd35-tiny", "--width", "128", "--height", "64"])
    plan = make_plan("sd35-tiny", 64, 64, 2**33)
    assert plan.offload == "none" and plan.largest_square == 64
