"""CUDA graphs and compiled forwards on a real GPU, on the tiny UNet in fp16.

A replayed graph runs the very kernels eager ran, so it must match eager exactly; inductor fuses
and reorders, so compiled output is held to 2e-2 of fp16 (about 10 ulp at the UNet's magnitudes).
"""
import pytest
import torch

from sdopt.optim.compile import CompileConfig, compile_forward
from sdopt.optim.cuda_graph import GraphedFunction
from sdopt.tools.modelgen import diffusers_unet_config

COMPILED = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture()
def unet():
    UNet2DConditionModel = pytest.importorskip("diffusers", reason="the tiny UNet is diffusers' (the .gpu bundle carries it)").UNet2DConditionModel
    torch.manual_seed(0)
    return UNet2DConditionModel(**{**diffusers_unet_config("tiny"), "sample_size": 8}).eval().cuda().half()


def call(unet, sample, timestep, context):
    return unet(sample, timestep, encoder_hidden_states=context).sample


def inputs(seed, size=16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randn(2, 4, size, size, device="cuda", generator=g, dtype=torch.half),
        torch.rand(2, device="cuda", generator=g) * 999,
        torch.randn(2, 7, 32, device="cuda", generator=g, dtype=torch.half),
    )


@torch.inference_mode()
def test_graph_replay_equals_eager_and_follows_new_weights(unet):
    graphed = GraphedFunction(lambda *a: call(unet, *a), lambda: list(unet.parameters()))
    for seed in range(3):
        torch.testing.assert_close(graphed(*inputs(seed)), call(unet, *inputs(seed)), rtol=0, atol=0)
    assert graphed.stats.captures == 1 and graphed.stats.eager_calls == 0
    unet.conv_in.weight = torch.nn.Parameter(unet.conv_in.weight * 2)
    torch.testing.assert_close(graphed(*inputs(5)), call(unet, *inputs(5)), rtol=0, atol=0)
    assert graphed.stats.invalidations == 1
    torch.testing.assert_close(graphed(*inputs(6, size=32)), call(unet, *inputs(6, size=32)), rtol=0, atol=0)
    assert graphed.stats.captures == 3


@pytest.mark.parametrize("mode", ["compile", "compile_regional", "trace"])
@torch.inference_mode()
def test_compiled_inside_a_graph_matches_eager(unet, mode):
    compiled = compile_forward(unet, call, CompileConfig(mode))
    graphed = GraphedFunction(compiled, lambda: list(unet.parameters()))
    for seed in range(2):
        torch.testing.assert_close(graphed(*inputs(seed)), call(unet, *inputs(seed)), **COMPILED)
    assert graphed.stats.eager_calls == 0, graphed.stats.summary()


@torch.inference_mode()
def test_channels_last_weights_compiled_inside_a_graph_match_eager(unet):
    """Precision's channels_last copy under the fast path: the layout inductor runs convolutions in."""
    from sdopt.optim.precision import converted_copy

    channels_last = converted_copy(unet, torch.float16, channels_last=True)
    assert channels_last.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    compiled = compile_forward(channels_last, call, CompileConfig("compile"))
    graphed = GraphedFunction(compiled, lambda: list(channels_last.parameters()))
    for seed in range(2):
        torch.testing.assert_close(graphed(*inputs(seed)), call(unet, *inputs(seed)), **COMPILED)
    assert graphed.stats.eager_calls == 0 and compiled.stats.recompile_reasons == [], graphed.stats.summary()
