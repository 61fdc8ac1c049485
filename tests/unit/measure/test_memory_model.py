"""Memory planner: the live-bytes count of a traced call against hand-counted bytes, the attention
override and low-memory settings on a tiny diffusers UNet, byte-size parsing, and the prediction of a
real convolution's peak RSS growth measured in a fresh process."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.optim.lowmem import LowMemConfig
from sdopt.measure.profiler import allocated_growth
from sdopt.measure.memory_model import (
    GlibcHeap, MemoryPlanConfig, fake_module, fake_tensor, fake_tensor_mode, largest_fitting, module_bytes, parse_bytes,
    predict_peak,
)

MiB = 2**20
# The planner's target: predicted peak within 20% of the measured peak RSS growth.
PREDICTION_TOLERANCE = 0.20


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("2048MiB", 2048 * MiB), ("512MB", 512 * 10**6), ("1.5G", int(1.5 * 2**30)),
    ("4096B", 4096), (" 2 gib ", 2 * 2**30), ("64k", 64 * 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "eight", "8 parsecs", "-1GiB", "0MiB", "1e3", "GiB", "8"])
def test_parse_bytes_rejects_with_the_option_name(text):
    with pytest.raises(UserError, match="--budget"):
        parse_bytes(text, "--budget")


def test_a_size_without_a_unit_is_refused_with_the_units_to_write():
    with pytest.raises(UserError, match="--vram-cap: '8' has no unit; write e.g. 8GiB or 8MiB"):
        parse_bytes("8", "--vram-cap")


def test_live_bytes_counts_new_storages_frees_and_workspace():
    mode = fake_tensor_mode()
    x = fake_tensor(mode, (1, 8, 64, 64))

    def fn(x):
        a = x * 2  # 128 KiB
        b = a + 1  # 128 KiB, peak 256 KiB with a alive
        del a
        return b.view(-1)  # a view: no new storage

    estimate = predict_peak(fn, x, config=MemoryPlanConfig(workspace="none"))
    assert estimate.peak_bytes == 2 * x.numel() * 4
    assert estimate.output_bytes == x.numel() * 4

    conv = fake_module(nn.Conv2d(8, 16, 3, padding=1, device="meta"), mode)
    none = predict_peak(conv, x, config=MemoryPlanConfig(workspace="none"))
    cpu = predict_peak(conv, x, config=MemoryPlanConfig(workspace="cpu"))
    assert none.peak_bytes == none.allocated_bytes == 1 * 16 * 64 * 64 * 4
    # oneDNN's blocked copy of the output, larger here than its reorders of the input and the weight, on
    # top of the output (plus malloc's chunk headers).
    reorders, output = x.numel() * 4 + module_bytes(conv) - 16 * 4, none.peak_bytes
    assert output > reorders
    assert cpu.peak_bytes - none.peak_bytes == pytest.approx(output, abs=64)
    # As allocated: the same output and workspace, without the heap's headers.
    assert cpu.allocated_bytes == 2 * output


def test_a_view_of_a_weight_is_not_a_new_storage_but_a_copy_of_its_slice_is():
    """SD3's MMDiT reshapes its whole stored position grid and crops it each call: only the crop is new."""
    mode = fake_tensor_mode()
    grid = fake_tensor(mode, (1, 64 * 64, 32))
    x = fake_tensor(mode, (1, 16, 32))
    estimate = predict_peak(lambda x: grid.reshape(1, 64, 64, 32)[:, :4, :4].reshape(1, -1, 32) + x, x,
                            config=MemoryPlanConfig(workspace="none"))
    assert estimate.peak_bytes == estimate.allocated_bytes == 2 * x.numel() * 4


def test_glibc_heap_reuses_larger_holes_maps_large_requests_and_trims_the_top():
    heap = GlibcHeap()
    heap.allocate("first", 4 * MiB)  # above the starting mmap threshold: mapped
    assert heap.resident_bytes == 4 * MiB + 16
    heap.release("first")  # unmapping raises the threshold to the mapping's size
    assert heap.resident_bytes == 0 and heap.mmap_threshold == 4 * MiB + 16
    for key in "abc":
        heap.allocate(key, 2 * MiB)
    heap.release("a")
    heap.allocate("same size", 2 * MiB)  # the freed chunk of exactly this size is not reused
    assert heap.resident_bytes == 4 * (2 * MiB + 16)
    heap.allocate("smaller", MiB)  # a smaller request fits in it
    assert heap.resident_bytes == 4 * (2 * MiB + 16)
    for key in ("smaller", "b", "c", "same size"):
        heap.release(key)
    # The freed top (8 MiB) is above twice the threshold: given back.
    assert heap.resident_bytes == 0


def test_predict_peak_needs_fake_tensors():
    with pytest.raises(UserError, match="fake tensors"):
        predict_peak(lambda x: x * 2, torch.ones(2))


def test_bad_config_names_the_field():
    with pytest.raises(UserError, match="workspace"):
        MemoryPlanConfig(workspace="tpu")
    with pytest.raises(UserError, match="backend"):
        MemoryPlanConfig(attention="nope")


@pytest.fixture(scope="module")
def tiny_unet():
    diffusers = pytest.importorskip("diffusers")
    from sdopt.tools.modelgen import diffusers_unet_config

    mode = fake_tensor_mode()
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**diffusers_unet_config("tiny")).eval()
    fake_module(unet, mode)
    inputs = (fake_tensor(mode, (2, 4, 32, 32)), fake_tensor(mode, (2,)), fake_tensor(mode, (2, 77, 32)))
    return (lambda x, t, c: unet(x, t, encoder_hidden_states=c).sample), inputs


def test_unet_settings_order(tiny_unet):
    fn, inputs = tiny_unet
    stock = predict_peak(fn, *inputs)
    sequential = predict_peak(fn, *inputs, config=MemoryPlanConfig(low_memory=LowMemConfig(
        budget_bytes=2**62, chunk_groupnorm=False, slice_convs=False, slice_feedforward=False)))
    chunked = predict_peak(fn, *inputs, config=MemoryPlanConfig(low_memory=LowMemConfig(budget_bytes=64 * 1024)))
    assert stock.output_bytes == sequential.output_bytes == inputs[0].numel() * 4
    # Batch 1 twice holds about half of batch 2's activations (plus the first half's output).
    assert sequential.peak_bytes < 0.75 * stock.peak_bytes
    assert chunked.peak_bytes < sequential.peak_bytes


def test_sub_quadratic_override_bounds_attention_scores():
    mode = fake_tensor_mode()
    q = fake_tensor(mode, (1, 2, 4096, 32))

    def attend(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    naive = predict_peak(attend, q, config=MemoryPlanConfig(attention="naive", workspace="none"))
    chunked = predict_peak(attend, q, config=MemoryPlanConfig(attention="sub_quadratic", attention_budget_bytes=MiB,
                                                              workspace="none"))
    scores = 2 * 4096 * 4096 * 4
    assert naive.peak_bytes >= scores
    out = q.numel() * 4
    # The output plus one chunk: scores within the budget, and the chunk's query, sums and accumulator.
    assert out < chunked.peak_bytes <= out + MiB + out
    assert chunked.output_bytes == out


def test_largest_fitting():
    assert largest_fitting(lambda side: side <= 1000) == 960
    assert largest_fitting(lambda side: side <= 10) is None
    assert largest_fitting(lambda side: True, high=2048) == 2048


_MEASURE_CONV = """
import json, sys, torch
from pathlib import Path
import torch.nn.functional as F
def status(field):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
x = torch.randn(1, 64, 512, 512); w = torch.randn(64, 64, 3, 3)
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
with torch.inference_mode():
    y = F.conv2d(x, w, padding=1)
print(json.dumps(status("VmHWM") - before))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from /proc (Linux)")
def test_conv_prediction_matches_measured_rss():
    measured = json.loads(subprocess.run([sys.executable, "-c", _MEASURE_CONV], capture_output=True, text=True,
                                         check=True).stdout)
    mode = fake_tensor_mode()
    x, w = fake_tensor(mode, (1, 64, 512, 512)), fake_tensor(mode, (64, 64, 3, 3))
    predicted = predict_peak(lambda x: torch.nn.functional.conv2d(x, w, padding=1), x).peak_bytes
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted / MiB, measured / MiB)


def test_a_convolutions_allocated_peak_is_what_the_profiler_reads():
    """The prediction as allocated against PyTorch's CPU allocator as the profiler sees it, within 2% (the
    channel padding of oneDNN's blocks): oneDNN where the output copy is the workspace (widening) and
    where the input and weight reorders are (narrowing); a single small image through PyTorch's own
    kernel (an im2col buffer, and none for a 1x1 kernel)."""
    mode = fake_tensor_mode()
    cases = [(1, 16, 32, 96, 3), (2, 64, 8, 96, 3), (1, 1280, 64, 4, 3), (1, 1280, 64, 4, 1), (1, 320, 320, 8, 3)]
    for batch, channels_in, channels_out, side, kernel in cases:
        x, w = torch.randn(batch, channels_in, side, side), torch.randn(channels_out, channels_in, kernel, kernel)
        conv = functools.partial(torch.nn.functional.conv2d, padding=kernel // 2)
        _, measured = allocated_growth("cpu", lambda: conv(x, w))
        fake_x, fake_w = fake_tensor(mode, x.shape), fake_tensor(mode, w.shape)
        predicted = predict_peak(lambda x: conv(x, fake_w), fake_x).allocated_bytes
        output = batch * channels_out * side * side * 4
        if batch == 1 and x.numel() <= 20480:
            im2col = 0 if kernel == 1 else channels_in * kernel * kernel * side * side * 4
            assert predicted == output + im2col
        else:
            assert predicted == output + max(output, x.numel() * 4 + w.numel() * 4)
        assert measured == pytest.approx(predicted, rel=0.02), (batch, channels_in, channels_out, side, kernel)
