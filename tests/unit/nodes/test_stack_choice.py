"""sdopt Auto's stack choice from faked device facts and predictions: a CPU, a large GPU, a small GPU, no
Triton; a UNet and a transformer; allow_approximate on and off; each goal."""
import dataclasses

import pytest

from sdopt.measure.memory_model import PLANNER_TOLERANCE
from sdopt.nodes.stack_choice import MIB, DeviceFacts, StepPrediction, choose_stack, need_bytes

GIB = 1024 * MIB
CPU = DeviceFacts(cuda=False, compile_problem=None, graph_problem="CUDA graphs need a CUDA device", has_convs=True,
                  cache_mode="deepcache", weights_bytes=2 * GIB, budget_bytes=16 * GIB)
LARGE_GPU = DeviceFacts(cuda=True, compile_problem=None, graph_problem=None, has_convs=True, cache_mode="deepcache",
                        weights_bytes=5 * GIB, budget_bytes=78 * GIB)
NO_TRITON = dataclasses.replace(LARGE_GPU, compile_problem="inductor needs Triton on CUDA")
TRANSFORMER = dataclasses.replace(LARGE_GPU, has_convs=False, cache_mode="first_block", weights_bytes=23 * GIB)


def predictions(plain: int, low_memory: int, inputs: int = MIB):
    """A ``predict`` that gives a plain step ``plain`` bytes of working memory and a Low Memory one ``low_memory``,
    and the stacks it was asked about."""
    asked = []

    def predict(stack):
        asked.append(stack.name)
        working = low_memory if stack.low_memory else plain
        return StepPrediction(working, inputs, working)

    return predict, asked


def nodes_of(choice) -> list[str]:
    return [step.node for step in choice.stack.steps]


def test_a_cpu_takes_compile_alone_and_needs_no_room_for_weights_already_in_ram():
    predict, _ = predictions(plain=300 * MIB, low_memory=100 * MIB)
    choice = choose_stack(CPU, "fastest", False, predict)
    assert nodes_of(choice) == ["SDOptCompile"] and choice.stack.exact
    assert choice.need_bytes == 300 * MIB + MIB


def test_a_large_gpu_takes_precision_attention_compile_and_graph_with_channels_last_on_a_unet():
    predict, _ = predictions(plain=2 * GIB, low_memory=GIB)
    choice = choose_stack(LARGE_GPU, "fastest", False, predict)
    assert nodes_of(choice) == ["SDOptPrecision", "SDOptAttention", "SDOptCompile", "SDOptCUDAGraph"]
    assert choice.stack.steps[0].values()["channels_last"] is True and choice.stack.holds_graph
    assert choice.need_bytes == 5 * GIB + MIB + 2 * 2 * GIB  # the graph's pool counted beside the eager peak


def test_a_transformer_stores_no_conv_weights_channels_last():
    predict, _ = predictions(plain=2 * GIB, low_memory=GIB)
    choice = choose_stack(TRANSFORMER, "fastest", False, predict)
    assert choice.stack.steps[0].values()["channels_last"] is False and "SDOptCUDAGraph" in nodes_of(choice)


def test_without_triton_the_gpu_stack_stays_eager_and_says_why():
    predict, _ = predictions(plain=2 * GIB, low_memory=GIB)
    choice = choose_stack(NO_TRITON, "fastest", False, predict)
    assert nodes_of(choice) == ["SDOptPrecision", "SDOptAttention"]
    assert any("inductor needs Triton" in reason for reason in choice.reasons)


def test_a_small_gpu_drops_to_low_memory_where_the_step_does_not_fit_and_names_what_it_ruled_out():
    small = dataclasses.replace(LARGE_GPU, budget_bytes=8 * GIB)
    predict, _ = predictions(plain=3 * GIB, low_memory=GIB)
    choice = choose_stack(small, "fastest", False, predict)
    assert nodes_of(choice) == ["SDOptPrecision", "SDOptLowMemory"] and choice.stack.exact
    (ruled,) = choice.ruled_out
    assert ruled[0] == "fast" and ruled[1] == 5 * GIB + MIB + 2 * 3 * GIB


def test_weights_that_do_not_fit_beside_the_step_are_offloaded_within_the_budget():
    tiny = dataclasses.replace(TRANSFORMER, budget_bytes=12 * GIB)
    predict, _ = predictions(plain=6 * GIB, low_memory=2 * GIB)
    choice = choose_stack(tiny, "fastest", False, predict)
    assert nodes_of(choice) == ["SDOptPrecision", "SDOptLowMemory", "SDOptOffload"]
    offload = choice.stack.steps[-1].values()
    assert offload["mode"] == "budget" and 0 < offload["budget_mb"] * MIB < tiny.budget_bytes
    assert choice.need_bytes <= tiny.budget_bytes


def test_nothing_fits_runs_the_least_memory_stack_and_says_so():
    hopeless = dataclasses.replace(TRANSFORMER, budget_bytes=GIB)
    predict, _ = predictions(plain=6 * GIB, low_memory=2 * GIB)
    choice = choose_stack(hopeless, "fastest", False, predict)
    assert choice.stack.steps[-1].values() == {"mode": "sequential", "budget_mb": 0, "on_unavailable": "fallback"}
    assert any("nothing is predicted to fit" in reason for reason in choice.reasons)


def test_balanced_keeps_the_planner_tolerance_free():
    predict, _ = predictions(plain=GIB, low_memory=GIB // 4)
    fast_need = need_bytes(choose_stack(LARGE_GPU, "fastest", False, predict).stack, StepPrediction(GIB, MIB, GIB), LARGE_GPU)
    just_fits = dataclasses.replace(LARGE_GPU, budget_bytes=fast_need)
    assert nodes_of(choose_stack(just_fits, "fastest", False, predict))[-1] == "SDOptCUDAGraph"
    assert "SDOptLowMemory" in nodes_of(choose_stack(just_fits, "balanced", False, predict))
    roomy = dataclasses.replace(LARGE_GPU, budget_bytes=int(fast_need * (1 + PLANNER_TOLERANCE)) + 1)
    assert nodes_of(choose_stack(roomy, "balanced", False, predict))[-1] == "SDOptCUDAGraph"


def test_fit_takes_the_least_memory_stack_even_where_the_fast_one_fits():
    predict, asked = predictions(plain=GIB, low_memory=GIB // 4)
    choice = choose_stack(LARGE_GPU, "fit", False, predict)
    assert "SDOptLowMemory" in nodes_of(choice) and choice.stack.steps[-1].values()["budget_mb"] == 64
    assert asked == [choice.stack.name]


@pytest.mark.parametrize("facts, cache", [(LARGE_GPU, "deepcache"), (TRANSFORMER, "first_block"), (CPU, "deepcache")])
def test_allow_approximate_adds_the_step_cache_that_fits_the_model_and_marks_the_stack_inexact(facts, cache):
    predict, _ = predictions(plain=GIB, low_memory=GIB // 4)
    exact = choose_stack(facts, "fastest", False, predict)
    approximate = choose_stack(facts, "fastest", True, predict)
    assert "SDOptStepCache" not in nodes_of(exact) and exact.stack.exact
    assert not approximate.stack.exact
    (cached,) = [step for step in approximate.stack.steps if step.node == "SDOptStepCache"]
    assert cached.values()["mode"] == cache
    compile_steps = [step for step in approximate.stack.steps if step.node == "SDOptCompile"]
    assert nodes_of(approximate).index("SDOptStepCache") < nodes_of(approximate).index("SDOptCompile")
    if cache == "first_block":  # its per-call decision runs beside regional compile, in no graph
        assert compile_steps[0].values()["mode"] == "compile_regional" and "SDOptCUDAGraph" not in nodes_of(approximate)


def test_no_prediction_runs_the_fastest_stack_and_says_so():
    choice = choose_stack(LARGE_GPU, "fastest", False, lambda stack: None)
    assert nodes_of(choice)[-1] == "SDOptCUDAGraph" and choice.need_bytes is None
    assert any("no prediction" in reason for reason in choice.reasons)


def test_an_unknown_goal_is_refused():
    with pytest.raises(ValueError, match="goal 'quick'"):
        choose_stack(CPU, "quick", False, lambda stack: None)
