"""compile_forward on the tiny UNet: equal to eager, one cache entry per new signature, none for
anything else, new weights used without recompiling, each forward's own recompile limit and
reasons, regional blocks past torch's default limit, and the persistent artifact cache.

Tolerances: the eager and aot_eager backends run the same kernels, so they match exactly up to
float32 reordering (2e-5); inductor fuses and reorders reductions (1e-4 relative on fp32).
"""
import os
import shutil
import timeit

import pytest
import torch

from sdopt.optim.compile import (
    INDUCTOR_CACHE_VAR, TRITON_CACHE_VAR, ArtifactCache, CompileConfig, CompileStats, cache_entries, compile_forward,
    foreign_items, nchw_conv_weight_bytes, purge_cache, repeated_blocks, unavailable_reason,
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
    reason, _fix = unavailable_reason(CompileConfig(backend="cudagraphs"), torch.device("cpu"))
    assert "CUDA device" in reason
    assert unavailable_reason(CompileConfig("trace"), torch.device("cpu")) is None


class TwoHalves(torch.nn.Module):
    """Two equal conv blocks across a graph break: inductor compiles the first half's graph and
    finds the second's, equal to it, in its cache within the same run."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.SiLU())
        self.second = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.SiLU())

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def conv_call(module, x):
    return module(x)


def _compile_in_a_fresh_start(cache_root, sizes) -> ArtifactCache:
    """``TwoHalves`` through inductor and sdopt's cache, with a fresh dynamo, forward and cache
    object as in a new process (torch's in-memory caches aside); each size is called twice, since
    the first call of a signature runs eagerly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = TwoHalves().eval()
    config = CompileConfig("compile", backend="inductor")
    compiled = compile_forward(module, conv_call, config)
    cache = ArtifactCache.for_module(module, config, cache_root)
    cache.load()
    fn = cache.wrap(compiled)
    for size in sizes:
        x = torch.randn(1, 4, size, size)
        fn(x)
        torch.testing.assert_close(fn(x), module(x), **TOL["inductor"])
    assert cache.save() == cache.folder
    return cache


@torch.inference_mode()
def test_inductors_caches_live_in_the_entry_so_a_purge_makes_the_next_compile_cold(tmp_path, monkeypatch):
    monkeypatch.delenv(INDUCTOR_CACHE_VAR, raising=False)
    monkeypatch.delenv(TRITON_CACHE_VAR, raising=False)
    cold = _compile_in_a_fresh_start(tmp_path, (8, 12))
    outside = [os.environ.get(INDUCTOR_CACHE_VAR), os.environ.get(TRITON_CACHE_VAR)]
    assert not any(str(tmp_path) in value for value in filter(None, outside)), "set only around sdopt's calls"
    held_nothing = "sdopt's compile cache held no graphs before this run"
    assert cold.compiles["1x4x8x8 (float32)"]["graphs_cached"] == 1, "the second half's graph, equal to the first's"
    assert cold.note() == "; ".join(f"cold compile of inputs 1x4x{n}x{n} (float32): {cold.compiles[f'1x4x{n}x{n} (float32)']['seconds']:.1f} s, "
                                    f"{held_nothing}" for n in (8, 12))
    assert (cold.folder / "fxgraph").is_dir() and any(cold.folder.rglob("*.so")), "inductor's graphs and C++ kernels"
    (entry,) = cache_entries(tmp_path)
    assert entry["bytes"] > (cold.folder / "artifacts.bin").stat().st_size, "the size counts inductor's files"
    cold_seconds = {signature: kept["cold_seconds"] for signature, kept in entry["compiles"].items()}
    assert set(cold_seconds) == {"1x4x8x8 (float32)", "1x4x12x12 (float32)"}, "one cold time per input signature"

    warm = _compile_in_a_fresh_start(tmp_path, (12,))
    assert warm.note() == (f"warm compile of inputs 1x4x12x12 (float32): {warm.compiles['1x4x12x12 (float32)']['seconds']:.1f} s, "
                           f"all 2 graph(s) from sdopt's compile cache; its cold compile took {cold_seconds['1x4x12x12 (float32)']:.1f} s")
    assert cache_entries(tmp_path)[0]["compiles"]["1x4x12x12 (float32)"]["cold_seconds"] == cold_seconds["1x4x12x12 (float32)"], "kept"

    assert purge_cache(tmp_path) == [warm.key] and not tmp_path.joinpath(warm.key).exists()
    assert _compile_in_a_fresh_start(tmp_path, (8,)).note().endswith(held_nothing)


def test_torch_caches_point_torch_at_the_entry_only_inside_and_respect_the_users_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir as torch_default, triton_cache_dir

    monkeypatch.setenv(INDUCTOR_CACHE_VAR, torch_default())  # what torch itself writes there on first use
    monkeypatch.delenv(TRITON_CACHE_VAR, raising=False)
    cache = ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), CompileConfig(), tmp_path)
    with cache.torch_caches():
        assert cache_dir() == str(cache.folder) and triton_cache_dir(0) == str(cache.folder / "triton")
        with cache.torch_caches():
            assert cache_dir() == str(cache.folder)
        assert cache_dir() == str(cache.folder)
    assert cache_dir() == os.path.abspath(torch_default()) and TRITON_CACHE_VAR not in os.environ
    assert [entry["key"] for entry in cache_entries(tmp_path)] == [cache.key], "marked as sdopt's before torch writes into it"

    monkeypatch.setenv(INDUCTOR_CACHE_VAR, str(tmp_path / "mine"))
    users = ArtifactCache.for_module(torch.nn.Conv2d(2, 2, 1), CompileConfig(), tmp_path)
    with users.torch_caches():
        assert cache_dir() == str(tmp_path / "mine")
    assert f"your {INDUCTOR_CACHE_VAR}={tmp_path / 'mine'}, which `python -m sdopt cache purge` leaves alone" in users.note()


def test_the_wrapped_call_costs_microseconds(tmp_path):
    class Forward:
        stats = CompileStats()

        def __call__(self, *inputs):
            return inputs

    bare = Forward()
    wrapped = ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), CompileConfig(), tmp_path).wrap(bare)
    inputs = (torch.zeros(1),) * 4
    per_call = {name: min(timeit.repeat(lambda: fn(*inputs), number=2000, repeat=5)) / 2000 for name, fn in (("bare", bare), ("wrapped", wrapped))}
    assert per_call["wrapped"] - per_call["bare"] < 50e-6, per_call  # about 4 µs measured: two variables set and put back


def test_only_sdopts_entries_are_listed_and_purged(tmp_path):
    entry = ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), CompileConfig(), tmp_path)
    with entry.torch_caches():
        (entry.folder / "fxgraph").mkdir()
        (entry.folder / "fxgraph" / "graph").write_bytes(b"x" * 100)
    (tmp_path / "someone_elses").mkdir()
    (tmp_path / "someone_elses" / "data").write_text("keep me")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "unmarked").mkdir()
    (tmp_path / "unmarked" / "meta.json").write_text('{"cold_compile_seconds": 3}')
    (tmp_path / "renamed").mkdir()
    shutil.copy(entry.folder / "meta.json", tmp_path / "renamed" / "meta.json")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "meta.json").write_text("{not json")
    (tmp_path / "link").symlink_to(entry.folder)
    foreign = ["garbled", "link", "notes.txt", "renamed", "someone_elses", "unmarked"]

    (listed,) = cache_entries(tmp_path)
    assert listed["key"] == entry.key and listed["bytes"] > 100 and listed["settings"] == "compile-inductor-default"
    assert foreign_items(tmp_path) == foreign
    assert purge_cache(tmp_path, "someone_elses") == [] and purge_cache(tmp_path) == [entry.key]
    assert sorted(p.name for p in tmp_path.iterdir()) == foreign and (tmp_path / "notes.txt").read_text() == "keep me"
    assert cache_entries(tmp_path / "notes.txt") == [] and purge_cache(tmp_path / "missing") == []


@torch.inference_mode()
def test_an_unreadable_artifact_is_ignored_with_a_warning(tmp_path):
    cache = ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), CompileConfig(), tmp_path)
    assert not cache.load()
    cache.folder.mkdir()
    (cache.folder / "artifacts.bin").write_bytes(b"not an artifact")
    with pytest.warns(UserWarning, match="unreadable compile cache"):
        assert not cache.load()


def test_the_cache_key_follows_the_architecture_not_the_weights(tiny_unet):
    config = CompileConfig()
    key = ArtifactCache.for_module(tiny_unet, config).key
    with torch.no_grad():
        next(tiny_unet.parameters()).add_(1)
    assert ArtifactCache.for_module(tiny_unet, config).key == key
    assert ArtifactCache.for_module(converted_copy(tiny_unet, torch.float32, channels_last=True), config).key != key, "layout"
    assert ArtifactCache.for_module(tiny_unet.half(), config).key != key
    assert ArtifactCache.for_module(tiny_unet, CompileConfig("trace")).key != key


def scaled(module, x):
    return module(x) * 2


def test_forwards_over_one_function_keep_their_own_entries_limit_and_reasons():
    """Every model's UNet call is one function: one forward's signatures must not use up another's
    recompile limit, nor its guard failures show up in the other's reasons."""
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    config = CompileConfig(backend="eager")
    a, b = compile_forward(first, scaled, config), compile_forward(second, scaled, config)
    with torch._dynamo.config.patch(recompile_limit=2):
        for rows in (1, 2, 3):
            x = torch.randn(rows, 4)
            for _ in range(2):  # the first call of a signature runs eagerly
                torch.testing.assert_close(a(x), scaled(first, x))
        assert a.stats.cache_entries == 2 and len(a.stats.eager_signatures) == 1
        assert "1 more input signature(s) ran eagerly: torch's recompile limit (2 per compiled model)" in a.stats.summary()
        x = torch.randn(5, 4)
        b(x), b(x)
        assert b.stats.cache_entries == 1 and not b.stats.eager_signatures
    assert b.stats.recompile_reasons == [], "the other forward's guard failures are not this one's"
    assert a.stats.recompile_reasons and all("\n" not in reason for reason in a.stats.recompile_reasons)


class Widening(torch.nn.Module):
    """Ten repeated blocks, each of another width: regional compile meets ten shapes in one call."""

    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = torch.nn.Linear(width, width + 1)

        def forward(self, x):
            return torch.nn.functional.gelu(self.proj(x))

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(self.Block(4 + i) for i in range(10))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_regional_blocks_of_more_shapes_than_the_recompile_limit_all_compile():
    """Weights are static to dynamo, so each block width compiles once: ten, past torch's default
    limit of 8, after which the blocks would silently run eagerly."""
    module = Widening()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig("compile_regional", backend="eager"))
    x = torch.randn(3, 4)
    fast(x)
    torch.testing.assert_close(fast(x), module(x))
    assert fast.stats.compilations == len(module.blocks), fast.stats.summary()
