"""compile_forward on the tiny UNet: every mode equal to eager, one cache entry per new signature
and none for anything else, new weights used without recompiling, regional blocks past torch's
default limit and whatever their strides, and the CPU speed trial."""
import time

import pytest
import torch

from sdopt.optim.compile import CompileConfig, compile_forward, repeated_blocks
from sdopt.optim.compile import forward as forward_module
from sdopt.optim.precision import converted_copy
from .support import TOL, Widening, unet_call, unet_inputs


@pytest.mark.parametrize("config", [
    CompileConfig("compile", backend="inductor"),
    CompileConfig("compile_regional", backend="inductor"),
    CompileConfig("trace"),
    CompileConfig("trace", freeze=True),
], ids=["compile-inductor", "regional-inductor", "trace", "trace-freeze"])
@torch.inference_mode()
def test_every_mode_matches_eager(tiny_unet, config):
    fast = compile_forward(tiny_unet, unet_call, config)
    for seed in (0, 1):
        torch.testing.assert_close(fast(*unet_inputs(seed=seed)), unet_call(tiny_unet, *unet_inputs(seed=seed)), **TOL["inductor"])


@torch.inference_mode()
def test_a_channels_last_copy_compiles_to_the_same_output(tiny_unet):
    """Precision's channels_last (conv weights NHWC) under inductor, whose convolutions follow the weights' layout."""
    channels_last = converted_copy(tiny_unet, torch.float32, channels_last=True)
    assert channels_last.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    fast = compile_forward(channels_last, unet_call, CompileConfig("compile", backend="inductor"))
    for seed in (0, 1):
        torch.testing.assert_close(fast(*unet_inputs(seed=seed)), unet_call(tiny_unet, *unet_inputs(seed=seed)), **TOL["inductor"])
    assert fast.stats.compilations >= 1


@pytest.mark.parametrize("mode", ["compile", "compile_regional", "trace"])
@torch.inference_mode()
def test_a_new_resolution_compiles_once_and_new_values_never(tiny_unet, mode):
    fast = compile_forward(tiny_unet, unet_call, CompileConfig(mode, backend="aot_eager"))
    fast(*unet_inputs(8, seed=0))
    assert fast.stats.compilations == 0, "the first call of a signature runs eagerly"
    fast(*unet_inputs(8, seed=5))
    compilations = fast.stats.compilations
    assert compilations >= 1 and fast.stats.cache_entries == 1
    fast(*unet_inputs(8, seed=1))
    assert fast.stats.compilations == compilations, fast.stats.recompile_reasons
    fast(*unet_inputs(16, seed=2))
    fast(*unet_inputs(16, seed=6))
    assert fast.stats.cache_entries == 2
    compilations = fast.stats.compilations
    for seed, size in ((3, 8), (4, 16)):
        torch.testing.assert_close(fast(*unet_inputs(size, seed=seed)), unet_call(tiny_unet, *unet_inputs(size, seed=seed)), **TOL["aot_eager"])
    assert fast.stats.compilations == compilations and fast.stats.cache_entries == 2


@torch.inference_mode()
def test_an_interrupted_first_call_leaves_the_eager_set_up_to_the_next_call(tiny_unet):
    """A user's Cancel raises inside the first, eager call of a signature: the next call of it is
    still the eager one, whose lazy set-up the compiled code must not meet half done."""
    calls = []

    def interrupted_once(unet, *inputs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise KeyboardInterrupt("cancelled")
        return unet_call(unet, *inputs)

    fast = compile_forward(tiny_unet, interrupted_once, CompileConfig("trace"))
    with pytest.raises(KeyboardInterrupt):
        fast(*unet_inputs(seed=0))
    fast(*unet_inputs(seed=0))
    assert fast.stats.compilations == 0, "the first call that finished is the eager one"
    fast(*unet_inputs(seed=1))
    assert fast.stats.compilations == 1


@pytest.mark.parametrize("config", [
    CompileConfig("compile", backend="aot_eager"),
    CompileConfig("compile_regional", backend="aot_eager"),
    CompileConfig("trace"),
    CompileConfig("trace", freeze=True),
], ids=["compile", "regional", "trace", "trace-freeze"])
@torch.inference_mode()
def test_replaced_weights_are_used(tiny_unet, config):
    fast = compile_forward(tiny_unet, unet_call, config)
    fast(*unet_inputs())
    fast(*unet_inputs())
    before = fast.stats.compilations
    for _ in range(2):
        for name, param in list(tiny_unet.named_parameters())[:40]:
            owner, _, leaf = name.rpartition(".")
            setattr(tiny_unet.get_submodule(owner), leaf, torch.nn.Parameter(param * 1.5 + 0.01, requires_grad=False))
        torch.testing.assert_close(fast(*unet_inputs()), unet_call(tiny_unet, *unet_inputs()), **TOL["aot_eager"])
    if config.mode == "trace" and not config.freeze:
        assert fast.stats.compilations == before and fast.stats.weight_rebinds == 2
    if config.freeze:
        assert "frozen trace" in fast.stats.summary()


@torch.inference_mode()
def test_weights_changed_in_place_are_used(tiny_unet):
    fast = compile_forward(tiny_unet, unet_call, CompileConfig("compile", backend="aot_eager"))
    fast(*unet_inputs())
    fast(*unet_inputs())
    compilations = fast.stats.compilations
    for param in tiny_unet.parameters():
        param.mul_(0.5)
    torch.testing.assert_close(fast(*unet_inputs()), unet_call(tiny_unet, *unet_inputs()), **TOL["aot_eager"])
    assert fast.stats.compilations == compilations


def test_regional_compile_picks_the_repeated_blocks(tiny_unet):
    names = {type(block).__name__ for block in repeated_blocks(tiny_unet)}
    assert "ResnetBlock2D" in names and "Transformer2DModel" in names
    assert not any(isinstance(block, (torch.nn.Conv2d, torch.nn.ModuleList)) for block in repeated_blocks(tiny_unet))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.linear(self.norm(x))


class _OtherBlock(_Block):
    pass


class _OneOfEachBlock(torch.nn.Module):
    """A DiT of one block of each kind, whose small helpers (the norms inside) repeat: Flux's mini."""

    def __init__(self):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([_Block()])
        self.single_blocks = torch.nn.ModuleList([_OtherBlock()])

    def forward(self, x):
        return self.single_blocks[0](self.double_blocks[0](x))


def test_regional_compile_takes_the_named_block_classes_even_where_one_of_each_occurs():
    model = _OneOfEachBlock()
    assert repeated_blocks(model) == [], "by count alone, no composite class repeats here"
    assert repeated_blocks(model, ("_Block", "_OtherBlock")) == [model.double_blocks[0], model.single_blocks[0]]
    assert repeated_blocks(model, ("NotInThisModel",)) == [], "none found: the count rule, which finds none either"

    fast = compile_forward(model, lambda module, x: module(x), CompileConfig("compile_regional", backend="aot_eager",
                                                                            block_classes=("_Block", "_OtherBlock")))
    x = torch.randn(2, 3, 4)
    with torch.inference_mode():
        fast(x)
        torch.testing.assert_close(fast(x), model(x))
    assert fast.stats.compilations == 2 and fast.stats.regional_blocks == {"_Block": 1, "_OtherBlock": 1}
    assert "by block: 1 _Block, 1 _OtherBlock" in fast.stats.summary()


def test_regional_compile_with_no_block_says_the_model_ran_eagerly():
    model = _OneOfEachBlock()
    fast = compile_forward(model, lambda module, x: module(x), CompileConfig("compile_regional", backend="aot_eager"))
    with torch.inference_mode():
        fast(torch.randn(2, 3, 4))
        fast(torch.randn(2, 3, 4))
    assert fast.stats.compilations == 0
    assert "no block to compile one by one" in fast.stats.shortfall()


@torch.inference_mode()
def test_regional_compile_leaves_the_module_as_it_was(tiny_unet):
    fast = compile_forward(tiny_unet, unet_call, CompileConfig("compile_regional", backend="aot_eager"))
    fast(*unet_inputs())
    fast(*unet_inputs())
    assert fast.stats.compilations and not any("forward" in vars(block) for block in repeated_blocks(tiny_unet))


def test_regional_blocks_of_more_shapes_than_the_recompile_limit_all_compile():
    """Weights are static to dynamo, so each block width compiles once: ten, past torch's default
    limit of 8, after which the blocks would silently run eagerly."""
    module = Widening()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig("compile_regional", backend="eager"))
    x = torch.randn(3, 4)
    fast(x)
    torch.testing.assert_close(fast(x), module(x))
    assert fast.stats.compilations == len(module.blocks), fast.stats.summary()


class Transposed(torch.nn.Module):
    """Three alike blocks, the first fed straight from a transpose (as SD3's first joint block is)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Widening.Block(6) for _ in range(3))
        for block in self.blocks:
            block.proj = torch.nn.Linear(6, 6)

    def forward(self, x):
        x = x.transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return x


@torch.inference_mode()
def test_regional_blocks_compile_once_whatever_the_strides_of_their_input():
    module = Transposed()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig("compile_regional", backend="eager"))
    x = torch.randn(2, 6, 5)
    fast(x)
    # the same values; a dense input can take another matmul kernel: fp32 rounding apart
    torch.testing.assert_close(fast(x), module(x), rtol=1e-5, atol=1e-6)
    assert fast.stats.compilations == 1, fast.stats.recompile_reasons


class Placed(torch.nn.Module):
    """Three alike blocks, each told its place in an options dict that it reads only to look up a
    patch (as ComfyUI's UNet blocks do), and that each block adds a key to for the next."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, options):
            patch = options.get("patches", {}).get(options.get("place"))
            options["seen"] = True
            return self.proj(x) if patch is None else patch(x)

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(self.Block() for _ in range(3))

    def forward(self, x):
        options = {"patches": {}}
        for place, block in enumerate(self.blocks):
            options["place"] = place
            x = block(x, options)
        return x


def _without_place(options: dict) -> dict:
    return {name: value for name, value in options.items() if name not in ("place", "seen")}


@pytest.mark.parametrize("block_options, compilations", [(None, 3), (_without_place, 1)], ids=["as-given", "place-left-out"])
@torch.inference_mode()
def test_alike_blocks_share_one_compile_where_their_place_is_left_out(block_options, compilations):
    """Dynamo guards on the place a block reads (and on the options' keys), so each block compiles
    apart; ``block_options`` hands them all the same options."""
    module = Placed()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig("compile_regional", backend="eager", block_options=block_options))
    x = torch.randn(2, 4)
    fast(x)
    torch.testing.assert_close(fast(x), module(x))
    assert fast.stats.compilations == compilations, fast.stats.recompile_reasons


# --- the speed trial: compiled code slower than eager turns itself off, on a CPU --------------------


def slowed(seconds: float):
    """A torch.compile backend whose compiled code runs ``seconds`` longer than eager."""
    def backend(graph_module, _example_inputs):
        def run(*args):
            time.sleep(seconds)
            return graph_module(*args)
        return run
    return backend


def test_speed_trial_turns_off_a_signature_whose_compiled_code_is_slower(monkeypatch):
    monkeypatch.setattr(forward_module, "MIN_TRIAL_SECONDS", 0.0)
    module = torch.nn.Linear(4, 4)
    fast = compile_forward(module, lambda m, x: m(x) * 2, CompileConfig(backend="eager"))
    fast._compiled = torch.compile(fast._compiled._torchdynamo_orig_callable, backend=slowed(0.02))
    x = torch.randn(2, 4)
    outputs = [fast(x) for _ in range(6)]  # eager first call, compile, eager reference, 2 compiled, then eager
    for out in outputs:
        torch.testing.assert_close(out, module(x) * 2)
    (trial,) = fast.stats.slower_than_eager.values()
    assert len(trial.compiled_seconds) == forward_module.TRIAL_CALLS and trial.speedup < forward_module.SLOWER_THAN_EAGER
    started = time.perf_counter()
    fast(x)
    assert time.perf_counter() - started < 0.02, "after the trial the signature runs eagerly"
    assert fast.stats.shortfall() == "off for 1 input signature(s): compiled ran slower than eager"
    assert "turned itself off for one input signature: compiled" in fast.stats.details()[0]


def test_speed_trial_keeps_compiled_code_that_is_as_fast(monkeypatch):
    monkeypatch.setattr(forward_module, "MIN_TRIAL_SECONDS", 0.0)
    trial = forward_module.SpeedTrial()
    trial.add(True, 0.100)
    trial.add(False, 0.104)
    assert not trial.decided
    trial.add(False, 0.099)
    assert trial.decided and not trial.compiled_slower and trial.speedup == pytest.approx(0.100 / 0.099)
    short = forward_module.SpeedTrial(eager_seconds=0.001)
    monkeypatch.setattr(forward_module, "MIN_TRIAL_SECONDS", 0.01)
    assert short.decided and not short.compiled_slower, "a call too short to time is left compiled"
