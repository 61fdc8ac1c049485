"""compile_forward on the tiny UNet: equal to eager, one cache entry per new signature, none for
anything else, new weights used without recompiling, each forward's own recompile limit and
reasons, regional blocks past torch's default limit, and the persistent artifact cache.

Tolerances: the eager and aot_eager backends run the same kernels, so they match exactly up to
float32 reordering (2e-5); inductor fuses and reorders reductions (1e-4 relative on fp32).
"""
import gc
import logging
import os
import shutil
import time
import timeit
import types
import weakref

import pytest
import torch

from sdopt.optim.compile import (
    INDUCTOR_CACHE_VAR, TRITON_CACHE_VAR, ArtifactCache, CompileConfig, CompileStats, cache_entries, compile_forward,
    foreign_items, nchw_conv_weight_bytes, purge_cache, repeated_blocks, unavailable,
)
from sdopt.optim import compile as compile_module
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


@pytest.fixture(autouse=True)
def no_speed_trials(request, monkeypatch):
    """Every test but the speed trial's own looks at compiled code, which a trial's eager call would skip."""
    if "speed_trial" not in request.node.name:
        monkeypatch.setattr(compile_module, "TRIAL_CALLS", 0)


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


def test_config_and_availability():
    with pytest.raises(ValueError, match="mode must be one of"):
        CompileConfig("jit")
    reason, _fix, input_name = unavailable(CompileConfig(backend="cudagraphs"), torch.device("cpu"))
    assert input_name == "backend"
    assert "CUDA device" in reason
    assert unavailable(CompileConfig("trace"), torch.device("cpu")) is None


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
    assert f"{INDUCTOR_CACHE_VAR}={tmp_path / 'mine'} (set in the environment), which `python -m sdopt cache purge` leaves alone" in users.note()


class _Forward:
    """What ``ArtifactCache.wrap`` reads of a ``CompiledForward``: its config and stats."""

    def __init__(self, config: CompileConfig):
        self.config = config
        self.stats = CompileStats()

    def __call__(self, *inputs):
        return inputs


def test_the_cpu_probe_is_asked_once_in_torchs_own_folder_not_in_the_entry(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir as torch_default

    monkeypatch.delenv(INDUCTOR_CACHE_VAR, raising=False)
    asked_in = []
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: asked_in.append(cache_dir()) or [])
    for config in (CompileConfig(mode="trace"), CompileConfig(backend="aot_eager")):
        ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), config, tmp_path).wrap(_Forward(config))(torch.zeros(1))
    assert asked_in == [], "only inductor compiles C++ for a CPU"

    forward = _Forward(CompileConfig(mode="compile_regional"))
    cache = ArtifactCache.for_module(torch.nn.Conv2d(1, 1, 1), forward.config, tmp_path)
    wrapped = cache.wrap(forward)
    wrapped(None, torch.zeros(1, device="meta"))
    assert asked_in == [], "no CPU input, no C++ kernel"
    wrapped(None, torch.zeros(1))
    wrapped(torch.zeros(1))
    assert asked_in == [os.path.abspath(torch_default())] and forward.stats.cpu_probed

    forward.stats.cpu_probe_seconds = 6.8
    assert "after torch's one-time probe of this CPU's vector instructions (6.8 s" in forward.stats.summary()
    forward.stats.cpu_probe_seconds = 0.01
    assert "probe" not in forward.stats.summary(), "an answer read from the folder is not worth a word"

    def broken_probe():
        raise RuntimeError("the probe's compiler crashed")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", broken_probe)
    other = _Forward(CompileConfig())
    assert ArtifactCache.for_module(torch.nn.Conv2d(3, 1, 1), other.config, tmp_path).wrap(other)(torch.ones(1))[0].item() == 1
    assert other.stats.cpu_probed and other.stats.cpu_probe_seconds == 0.0, "a broken probe never stops the compile"


def test_the_wrapped_call_costs_microseconds(tmp_path):
    bare = _Forward(CompileConfig())
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


def _live(kind: type) -> int:
    gc.collect()
    return sum(issubclass(type(o), kind) for o in gc.get_objects())


@pytest.mark.parametrize("mode", ["compile", "compile_regional", "trace"])
@torch.inference_mode()
def test_a_compiled_model_that_is_gone_leaves_no_graphs_behind(mode):
    """Dynamo keeps a compiled code object's graphs in the code's extra state, out of the garbage
    collector's sight, its guards alive through finalizers on long-lived objects, a dynamic compile's
    shape environment in a cycle through C++ and in memoized methods, and torch.fx every graph's
    generated source; a traced module puts a type per submodule, and a traced function itself, into
    TorchScript's process-wide unit. A server that compiles model after model must keep none of these
    for every model."""
    from torch._dynamo.guards import CheckFunctionManager
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def compile_and_drop():
        net = Widening()
        forward = compile_forward(net, lambda m, x: m(x), CompileConfig(mode, backend="eager"))
        x = torch.randn(2, 4)
        forward(x), forward(x)
        assert forward.stats.compilations, "the compiled call ran"
        return weakref.ref(net)

    def collected_and_swept():
        gc.collect()  # the dropped models' finalizers release their compiled code
        compile_module.sweep_dead_guards()  # what the next compile would do first

    compile_and_drop()
    collected_and_swept()
    graphs, guards, types_, shape_envs = _live(torch.fx.GraphModule), _live(CheckFunctionManager), _live(type), _live(ShapeEnv)
    graph_sources = len(torch.fx.graph_module._loader.eval_cache)
    script_functions = len(torch.jit._state._python_cu.get_functions())
    models = [compile_and_drop() for _ in range(3)]
    assert all(model() is None for model in models)
    collected_and_swept()
    assert _live(torch.fx.GraphModule) <= graphs, "each compiled model left its graphs in the process"
    assert _live(CheckFunctionManager) <= guards, "each compiled model left its guards in the process"
    assert _live(ShapeEnv) <= shape_envs, "each compiled model left its dynamic shapes' environments in the process"
    assert len(torch.fx.graph_module._loader.eval_cache) <= graph_sources, "each compiled model left its graphs' source in torch.fx's cache"
    assert _live(type) <= types_, "each traced model left TorchScript types (one per submodule) in the process"
    assert len(torch.jit._state._python_cu.get_functions()) <= script_functions, "each trace left its graph in TorchScript's unit"


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


# --- what torch gave up on, and graphs made by another compile --------------------------------------


def reads_a_file(x):
    """A function torch cannot trace whole: ``open`` breaks the graph, as psutil does in ComfyUI's CPU attention."""
    with open(os.devnull) as handle:
        handle.read()
    return x * 2 + 1


class CallsAFileReader(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return reads_a_file(self.proj(x)).relu()


def test_a_graph_break_and_the_function_torch_gave_up_on_are_named_with_reason_and_fix():
    module = CallsAFileReader()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig(backend="eager"))
    x = torch.randn(2, 4)
    fast(x)
    torch.testing.assert_close(fast(x), module(x))
    stats = fast.stats
    ((reason, functions),) = stats.graph_breaks.items()
    assert "`open`" in reason and "\n" not in reason
    assert functions[0].startswith("reads_a_file (test_compile.py:"), "the function with the untraceable call comes first"
    assert not any(name.startswith("forward (compile.py") for name in functions), "sdopt's own wrapper is not named"
    assert any(gave_up.function.startswith("reads_a_file") for gave_up in stats.gave_up.values()), stats.gave_up
    details = "; ".join(stats.details())
    assert f"graph break ({reason}) in reads_a_file" in details and compile_module.GRAPH_BREAK_FIX in details
    assert "torch gave up on" in details and compile_module.EAGER_FRAME_FIX in details
    assert stats.shortfall().startswith(f"{len(stats.gave_up)} function(s) ran eagerly (")
    assert "graph broken in" in stats.shortfall()


def test_a_model_torch_traces_whole_has_nothing_to_report():
    module = torch.nn.Linear(4, 4)
    fast = compile_forward(module, lambda m, x: m(x) * 2, CompileConfig(backend="eager"))
    x = torch.randn(2, 4)
    fast(x), fast(x)
    assert fast.stats.compilations == 1
    assert (fast.stats.graph_breaks, fast.stats.gave_up, fast.stats.reused) == ({}, {}, {})
    assert fast.stats.details() == [] and fast.stats.shortfall() == ""


def test_torchs_recompile_limit_warning_names_the_function_it_gave_up_on():
    """Faked: the warning as torch logs it (torch/_dynamo/convert_frame.py), while a compile is accounted."""
    stats = CompileStats(owner="test")
    warn = logging.getLogger("torch._dynamo.convert_frame").warning
    with compile_module.accounted(stats):
        warn("torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s\nTo log all recompilation reasons, use "
             'TORCH_LOGS="recompiles".', "recompile_limit", 8,
             "'torch_dynamo_resume_in_attention_sub_quad_at_234' (/comfy/ldm/modules/attention.py:234)",
             "17/7: tensor 'key' size mismatch at index 2. expected 77, actual 16")
    warn("torch._dynamo hit config.%s (%s)\n   function: %s\n", "recompile_limit", 8, "'outside' (/x.py:1)")  # no compile accounted
    (gave_up,) = stats.gave_up.values()
    assert gave_up.function == "attention_sub_quad (attention.py:234)"
    assert gave_up.reason == "hit torch's recompile_limit (8); last recompile because tensor 'key' size mismatch at index 2. expected 77, actual 16"
    assert gave_up.fix == compile_module.RECOMPILE_LIMIT_FIX
    assert "torch gave up on attention_sub_quad (attention.py:234) (hit torch's recompile_limit (8)" in stats.details()[0]
    assert stats.shortfall() == "1 function(s) ran eagerly (attention_sub_quad (attention.py:234))"


def test_compilation_metrics_file_breaks_and_eager_frames_but_leave_the_limit_to_its_warning():
    """Faked: torch's CompilationMetrics of a split frame, a frame it gave up on, and a recompile-limit hit."""
    def metric(co_name, restart=(), fail_type=None, fail_reason=None):
        return types.SimpleNamespace(co_name=co_name, co_filename="/comfy/attention.py" if co_name else None, co_firstlineno=7,
                                     restart_reasons=set(restart), fail_type=fail_type, fail_reason=fail_reason)

    stats = CompileStats()
    unsupported = "Failed to trace builtin operator\n  Explanation: Dynamo does not know how to trace `open`. More.\n  Hint: avoid it"
    compile_module.note_metric(stats, metric("forward", restart=[unsupported]))
    compile_module.note_metric(stats, metric("torch_dynamo_resume_in_get_free_memory_at_1265", restart=[unsupported]))
    compile_module.note_metric(stats, metric("wrapper", fail_type="Unsupported", fail_reason=unsupported))
    compile_module.note_metric(stats, metric(None, fail_type="Unsupported", fail_reason="Dynamo recompile limit exceeded"))
    reason = "Failed to trace builtin operator: Dynamo does not know how to trace `open`"
    assert stats.graph_breaks == {reason: ["get_free_memory (attention.py:7)", "forward (attention.py:7)"]}
    assert list(stats.gave_up) == ["wrapper (attention.py:7)"]
    assert stats.gave_up["wrapper (attention.py:7)"].reason == reason


def test_graph_break_reasons_tell_a_whole_graph_from_a_broken_one():
    x = torch.randn(3)
    assert compile_module.graph_break_reasons(lambda t: torch.nn.functional.gelu(t) * 2, x) == []
    reasons = compile_module.graph_break_reasons(reads_a_file, x)
    assert reasons and "`open`" in reasons[0]


def test_each_compiled_model_keeps_the_pieces_a_graph_break_leaves_outside():
    """Where torch isolates recompiles, a second model compiles its own pieces and reuses nothing."""
    if not compile_module.isolated_recompiles():
        pytest.skip("this torch shares every function's entries between compiled models")
    x = torch.randn(2, 4)
    first, second = (compile_forward(CallsAFileReader(), lambda m, t: m(t), CompileConfig(backend="eager")) for _ in range(2))
    for fast in (first, second):
        fast(x), fast(x)
    assert second.stats.compilations == first.stats.compilations > 1
    assert second.stats.reused == {} and second.stats.isolated
    assert "its own (torch's isolate_recompiles)" in "; ".join(second.stats.details())


def test_graphs_made_by_an_earlier_compile_are_counted_with_their_owner(monkeypatch):
    """Without isolation (older torch, faked by switching it off) the pieces outside sdopt's own code
    are shared: the second model runs graphs the first compiled, and says whose."""
    monkeypatch.setattr(compile_module, "isolated_recompiles", lambda: {})
    x = torch.randn(2, 4)
    first, second = (compile_forward(CallsAFileReader(), lambda m, t: m(t), CompileConfig(backend="eager")) for _ in range(2))
    for fast in (first, second):
        fast(x), fast(x)
    assert first.stats.reused == {}
    assert second.stats.compilations < first.stats.compilations
    ((owner, graphs),) = second.stats.reused.items()
    assert owner == first.stats.owner and owner.startswith("sdopt compiled model #") and graphs >= 1
    assert f"reused {graphs} graph(s) compiled earlier in this process by {owner}" in second.stats.details()
    assert "shared with every compiled model in this process" in "; ".join(second.stats.details())


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
    monkeypatch.setattr(compile_module, "MIN_TRIAL_SECONDS", 0.0)
    module = torch.nn.Linear(4, 4)
    fast = compile_forward(module, lambda m, x: m(x) * 2, CompileConfig(backend="eager"))
    fast._compiled = torch.compile(fast._compiled._torchdynamo_orig_callable, backend=slowed(0.02))
    x = torch.randn(2, 4)
    outputs = [fast(x) for _ in range(6)]  # eager first call, compile, eager reference, 2 compiled, then eager
    for out in outputs:
        torch.testing.assert_close(out, module(x) * 2)
    (trial,) = fast.stats.slower_than_eager.values()
    assert len(trial.compiled_seconds) == compile_module.TRIAL_CALLS and trial.speedup < compile_module.SLOWER_THAN_EAGER
    started = time.perf_counter()
    fast(x)
    assert time.perf_counter() - started < 0.02, "after the trial the signature runs eagerly"
    assert fast.stats.shortfall() == "off for 1 input signature(s): compiled ran slower than eager"
    assert "turned itself off for one input signature: compiled" in fast.stats.details()[0]


def test_speed_trial_keeps_compiled_code_that_is_as_fast(monkeypatch):
    monkeypatch.setattr(compile_module, "MIN_TRIAL_SECONDS", 0.0)
    trial = compile_module.SpeedTrial()
    trial.add(True, 0.100)
    trial.add(False, 0.104)
    assert not trial.decided
    trial.add(False, 0.099)
    assert trial.decided and not trial.compiled_slower and trial.speedup == pytest.approx(0.100 / 0.099)
    short = compile_module.SpeedTrial(eager_seconds=0.001)
    monkeypatch.setattr(compile_module, "MIN_TRIAL_SECONDS", 0.01)
    assert short.decided and not short.compiled_slower, "a call too short to time is left compiled"
