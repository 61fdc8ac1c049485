"""compile_forward on the tiny UNet: equal to eager, one cache entry per new signature, none for
anything else, new weights used without recompiling, and the persistent artifact cache.

Tolerances: the eager and aot_eager backends run the same kernels, so they match exactly up to
float32 reordering (2e-5); inductor fuses and reorders reductions (1e-4 relative on fp32).
"""
import pytest
import torch

from sdopt.optim.compile import (
    ArtifactCache, CompileConfig, cache_entries, compile_forward, nchw_conv_weight_bytes, purge_cache, repeated_blocks,
    unavailable_reason,
)
from sdopt.optim.precision import converted_copy


def unet_call(unet, sample, timestep, context):
    return unet(sample, timestep, encoder_hidden_states=context).sample


def unet_inputs(size=8, batch=2, seed=0, tokens=7):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 4, size, size, generator=g),
        torch.rand(batch, generator=g) * 999,
        torch.randn(batch, tokens, 32, generator=g),
    )


TOL = {"aot_eager": dict(rtol=2e-5, atol=2e-5), "inductor": dict(rtol=1e-4, atol=1e-4)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


def test_nchw_conv_weights_are_counted_where_inductor_would_convert_them():
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Linear(3, 3), torch.nn.Conv2d(8, 2, 3))
    conv_bytes = (8 * 4 * 9 + 2 * 8 * 9) * 4
    assert nchw_conv_weight_bytes(module, CompileConfig()) == conv_bytes
    assert nchw_conv_weight_bytes(module, CompileConfig("compile_regional")) == conv_bytes
    assert nchw_conv_weight_bytes(converted_copy(module, torch.float32, channels_last=True), CompileConfig()) == 0
    assert nchw_conv_weight_bytes(module, CompileConfig("trace")) == 0
    assert nchw_conv_weight_bytes(module, CompileConfig(backend="aot_eager")) == 0


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


@torch.inference_mode()
def test_regional_compile_leaves_the_module_as_it_was(tiny_unet):
    fast = compile_forward(tiny_unet, unet_call, CompileConfig("compile_regional", backend="aot_eager"))
    fast(*unet_inputs())
    fast(*unet_inputs())
    assert fast.stats.compilations and not any("forward" in vars(block) for block in repeated_blocks(tiny_unet))


def test_config_and_availability():
    with pytest.raises(ValueError, match="mode must be one of"):
        CompileConfig("jit")
    assert "CUDA device" in unavailable_reason(CompileConfig(backend="cudagraphs"), torch.device("cpu"))
    assert unavailable_reason(CompileConfig("trace"), torch.device("cpu")) is None


@torch.inference_mode()
def test_artifact_cache_saves_lists_loads_and_purges(tiny_unet, tmp_path):
    config = CompileConfig("compile", backend="inductor")
    cache = ArtifactCache.for_module(tiny_unet, config, tmp_path)
    assert not cache.load()
    fast = compile_forward(tiny_unet, unet_call, config)
    fast(*unet_inputs())
    fast(*unet_inputs())
    assert cache.save(fast.stats.compile_seconds) == cache.folder
    (entry,) = cache_entries(tmp_path)
    assert entry["key"] == cache.key and entry["bytes"] > 0 and entry["settings"] == "compile-inductor-default"
    assert cache.cold_compile_seconds() == pytest.approx(fast.stats.compile_seconds, abs=0.01)
    assert cache.load()
    (cache.folder / "artifacts.bin").write_bytes(b"not an artifact")
    with pytest.warns(UserWarning, match="unreadable compile cache"):
        assert not cache.load()
    assert purge_cache(tmp_path) == [cache.key] and cache_entries(tmp_path) == []


def test_the_cache_key_follows_the_architecture_not_the_weights(tiny_unet):
    config = CompileConfig()
    key = ArtifactCache.for_module(tiny_unet, config).key
    with torch.no_grad():
        next(tiny_unet.parameters()).add_(1)
    assert ArtifactCache.for_module(tiny_unet, config).key == key
    assert ArtifactCache.for_module(converted_copy(tiny_unet, torch.float32, channels_last=True), config).key != key, "layout"
    assert ArtifactCache.for_module(tiny_unet.half(), config).key != key
    assert ArtifactCache.for_module(tiny_unet, CompileConfig("trace")).key != key
