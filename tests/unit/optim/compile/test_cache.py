"""ArtifactCache: torch's caches routed into the entry only while sdopt's code runs, a purge makes the
next compile cold, the CPU probe asked in torch's own folder, only sdopt's entries listed and purged,
unreadable artifacts ignored, the key following the architecture."""
import os
import shutil
import timeit

import pytest
import torch

from sdopt.optim.compile import (
    ArtifactCache, CompileConfig, CompileStats, cache_entries, compile_forward, foreign_items, purge_cache,
)
from sdopt.optim.compile.cache import INDUCTOR_CACHE_VAR, TRITON_CACHE_VAR
from sdopt.optim.precision import converted_copy
from .support import TOL


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
