"""The step profile: busy time as a union of intervals, CUDA and CPU events told apart, host syncs
counted, and a real profiled call on this CPU."""
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from sdopt.measure.step_profile import DeviceActivity, busy_union, profile_device, summarize


def event(name, start, end, device=DeviceType.CPU, self_us=None):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           self_cpu_time_total=end - start if self_us is None else self_us)


def test_busy_union_counts_overlapping_and_nested_time_once():
    assert busy_union([]) == 0
    assert busy_union([(0, 10), (2, 4), (8, 15), (20, 25)]) == 20
    assert busy_union([(5, 6), (0, 1)]) == 2


def test_cuda_busy_time_is_kernels_and_copies_and_syncs_are_runtime_waits():
    events = [
        event("aten::conv2d", 0, 50),  # host side: not device work
        event("cudaLaunchKernel", 1, 2),
        event("sm90_conv_kernel", 10, 40, DeviceType.CUDA),
        event("triton_poi_fused_add", 35, 45, DeviceType.CUDA),  # overlaps the conv on another stream
        event("Memcpy DtoD", 60, 61, DeviceType.CUDA),
        event("cudaStreamSynchronize", 70, 80),
        event("cudaMemcpyAsync", 81, 82),
    ]
    activity = summarize(events, "cuda")
    assert activity.busy_us == 36 and activity.activities == 3 and activity.host_syncs == 1
    assert activity.top[0] == ("sm90_conv_kernel", 30)


def test_cpu_busy_time_is_aten_ops_and_value_reads_count_as_syncs():
    events = [
        event("aten::linear", 0, 10, self_us=2),
        event("aten::addmm", 1, 9),  # nested in linear: its time counts once in the busy time
        event("my_python_range", 0, 100),
        event("aten::_local_scalar_dense", 20, 21),
    ]
    activity = summarize(events, "cpu")
    assert activity.busy_us == 10 and activity.activities == 2 and activity.host_syncs == 1
    assert dict(activity.top) == {"aten::addmm": 8, "aten::linear": 2}


def test_on_a_cpu_a_compiled_graph_call_is_busy_time_with_its_kernels_named():
    events = [
        event("## Call CompiledFxGraph fabc123 ##", 0, 100, self_us=70),
        event("aten::convolution", 10, 40),  # an extern kernel inside the compiled graph
        event("Torch-Compiled Region: 0/0", 0, 120),
    ]
    activity = summarize(events, "cpu")
    assert activity.busy_us == 100 and activity.activities == 2
    assert activity.top[0] == ("inductor kernels (compiled graph)", 70)


def test_syncs_count_only_inside_the_span_where_one_is_named():
    events = [
        event("sampler", 100, 200),
        event("aten::_local_scalar_dense", 50, 51),  # set-up, before the span
        event("aten::_local_scalar_dense", 150, 151),
        event("aten::_local_scalar_dense", 250, 251),
    ]
    assert summarize(events, "cpu").host_syncs == 3
    assert summarize(events, "cpu", span="sampler").host_syncs == 1
    assert summarize(events, "cpu", span="absent").host_syncs == 0


def test_per_step_sets_busy_time_beside_the_unprofiled_step():
    step = DeviceActivity("cuda", busy_us=7000 * 20, activities=400 * 20, host_syncs=3, top=[("k", 3500 * 20)]).per_step(20, 0.0077)
    assert step.busy_ms == pytest.approx(7.0) and step.wall_ms == pytest.approx(7.7)
    assert step.busy_share == pytest.approx(7.0 / 7.7) and step.bound_by == "device"
    assert step.activities_per_step == 400 and step.top == [("k", 0.5)]
    assert DeviceActivity("cuda", 2000, 10, 20).per_step(1, 0.004).bound_by == "host"
    assert DeviceActivity("cpu", 2000, 10, 0).per_step(1, 0.004).to_dict()["bound_by"] == "Python"


def test_a_profiled_cpu_call_returns_its_result_and_what_ran(tmp_path):
    def work():
        a = torch.randn(128, 128)
        for _ in range(5):
            a = torch.tanh(a @ a)
        return a.sum().item()

    trace = tmp_path / "sub" / "work.trace.json.gz"
    result, activity = profile_device(work, "cpu", trace)
    assert isinstance(result, float) and trace.stat().st_size > 0
    assert activity.host_syncs == 1 and activity.busy_us > 0 and activity.activities >= 11
    assert "aten::mm" in dict(activity.top)


def test_op_categories_by_name():
    from sdopt.measure.step_profile import op_category

    assert [op_category(name) for name in (
        "sm90_xmma_gemm_bf16bf16_bf16f32", "aten::linear", "aten::convolution", "flash_fwd_kernel", "aten::_scaled_dot_product_flash_attention_for_cpu",
        "triton_poi_fused_add_mul_0", "## Call CompiledFxGraph fabc ##", "aten::copy_", "Memcpy DtoD", "aten::group_norm",
        "void at::native::vectorized_elementwise_kernel<4, silu>", "aten::arange")] == [
        "matmul", "matmul", "matmul", "attention", "attention", "fused (compiled)", "fused (compiled)", "copies", "copies",
        "normalisation, elementwise", "normalisation, elementwise", "other"]


def test_on_a_cpu_an_op_counts_in_its_category_with_its_children_and_ops_outside_graphs_are_named():
    events = [
        event("aten::scaled_dot_product_attention", 0, 40, self_us=5),
        event("aten::bmm", 5, 30),  # attention's own matmul: attention's time
        event("aten::linear", 50, 70),
        event("## Call CompiledFxGraph fabc ##", 100, 200, self_us=90),
        event("aten::convolution", 110, 120),  # an extern kernel inside the graph: a matmul, not fused
        event("aten::copy_", 210, 220),
        event("aten::copy_", 230, 240),
    ]
    activity = summarize(events, "cpu")
    assert activity.categories == {"attention": 40, "matmul": 30, "fused (compiled)": 90, "copies": 20}
    assert activity.outside_graphs == [("aten::copy_", 2), ("aten::scaled_dot_product_attention", 1), ("aten::linear", 1)]
    step = activity.per_step(2, 0.0002)  # 180 us busy over 2 steps of 200 us: 45% busy
    shares = dict(step.categories)
    assert shares["fused (compiled)"] == pytest.approx(90 / 180 * 0.45) and shares["host gaps"] == pytest.approx(0.55)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert step.outside_graphs == [("aten::copy_", 1.0), ("aten::scaled_dot_product_attention", 0.5), ("aten::linear", 0.5)]


def test_cuda_kernels_count_in_their_category_and_eager_runs_name_nothing_outside_graphs():
    events = [
        event("aten::mm", 0, 5),
        event("sm90_xmma_gemm", 10, 40, DeviceType.CUDA),
        event("flash_fwd_kernel", 40, 60, DeviceType.CUDA),
        event("Memcpy HtoD", 60, 62, DeviceType.CUDA),
    ]
    activity = summarize(events, "cuda")
    assert activity.categories == {"matmul": 30, "attention": 20, "copies": 2} and activity.outside_graphs is None
    assert activity.per_step(1, 0.0001).outside_graphs is None


def test_the_tables_give_a_row_per_run_with_its_categories_and_the_ops_outside_graphs():
    from sdopt.measure.step_profile import step_category_table, step_profile_table

    eager = DeviceActivity("cpu", 600, 30, 0, [("aten::addmm", 400)], {"matmul": 400, "copies": 200}).per_step(2, 0.0005)
    compiled = DeviceActivity("cpu", 400, 3, 0, [], {"fused (compiled)": 400}, [("aten::mul", 4)]).per_step(2, 0.0004)
    profiles = {"stock": eager.to_dict(), "compile": compiled.to_dict()}
    categories = step_category_table(profiles).splitlines()
    assert categories[0].startswith("| rung | step ms | matmul | attention |") and len(categories) == 4
    assert categories[2] == "| stock | 0.50 | 40% | 0% | 0% | 20% | 0% | 0% | 40% | no compiled graph |"
    assert categories[3] == "| compile | 0.40 | 0% | 0% | 0% | 0% | 50% | 0% | 50% | aten::mul 2 |"
    assert "| stock | 0.50 | 0.30 | 60% | Python | 15 | 0 | aten::addmm 67% |" in step_profile_table(profiles)
    assert step_category_table({}) == step_profile_table({}) == ""
