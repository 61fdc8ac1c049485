"""sdopt's compile cache: a folder per architecture, torch version and settings
(``ArtifactCache``). While sdopt's compiled code runs, torch's own compiler caches (inductor's graphs
and kernels, Triton's) are read and written there, beside torch's portable artifacts
(``torch.compiler.save_cache_artifacts``), so a new process compiles warm and deleting the folder
makes the next compile cold. Only folders it marked as its own are listed or purged."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import CompileConfig
from .forward import CompiledForward, on_cpu
from .modes import named_state

ARTIFACTS = "artifacts.bin"
META = "meta.json"

def default_cache_dir() -> Path:
    if os.environ.get("SDOPT_CACHE_DIR"):
        return Path(os.environ["SDOPT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdopt" / "compile"


def architecture_hash(module: torch.nn.Module) -> str:
    """A hash of the module's class and tensor names, shapes, strides and dtypes: compiled code
    depends on these (the strides say which weights are channels-last), not on the weight values,
    which stay inputs."""
    digest = hashlib.sha256(type(module).__qualname__.encode())
    for name, tensor in named_state(module).items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.stride()}:{tensor.dtype}".encode())
    return digest.hexdigest()[:16]


WRITTEN_BY = "sdopt compile cache"  # meta.json's mark: only folders that carry it are listed and purged
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_VAR = "TRITON_CACHE_DIR"


def _timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _torch_default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    return os.path.abspath(torch_default())


def users_cache_dirs() -> dict[str, str]:
    """The torch cache variables the user set, which sdopt leaves as they are. torch sets them too,
    to its defaults, on first use: ``TORCHINDUCTOR_CACHE_DIR`` to /tmp/torchinductor_<user> and
    ``TRITON_CACHE_DIR`` to <that>/triton/<device>; those values are not the user's."""
    default = _torch_default_cache_dir()
    chosen = {}
    inductor = os.environ.get(INDUCTOR_CACHE_VAR)
    if inductor and os.path.abspath(inductor) != default:
        chosen[INDUCTOR_CACHE_VAR] = inductor
    triton = os.environ.get(TRITON_CACHE_VAR)
    if triton and os.path.dirname(os.path.abspath(triton)) != os.path.join(default, "triton"):
        chosen[TRITON_CACHE_VAR] = triton
    return chosen


def _memoized_cache_path_clear() -> Callable[[], None]:
    """inductor memoizes the path of its benchmark-result cache (``CacheBase.get_local_cache_path``)
    on first use; clearing it at each switch gives each side of the switch its own."""
    try:
        from torch._inductor.codecache import CacheBase

        return CacheBase.get_local_cache_path.cache_clear
    except (ImportError, AttributeError):
        return lambda: None


class _TorchCacheRouting:
    """Sets the cache variables for the calls inside and puts back what was there after, as torch's
    own ``fresh_cache`` does: inductor and Triton read them on every use. Re-entrant."""

    def __init__(self, variables: dict[str, str]):
        self.variables = variables
        self.forget_memoized = _memoized_cache_path_clear() if variables else (lambda: None)
        self.saved: list[dict[str, str | None]] = []

    def __enter__(self):
        self.saved.append({name: os.environ.get(name) for name in self.variables})
        os.environ.update(self.variables)
        self.forget_memoized()
        return self

    def __exit__(self, *_exc):
        for name, value in self.saved.pop().items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.forget_memoized()


def probe_cpu_vector_isa() -> float:
    """Seconds spent on torch's CPU vector-instruction probe, asked for here where it is cheapest.

    inductor dry-compiles and loads a test library per x86 vector ISA (AVX2, AVX-512, ...) in each
    cache folder it meets and remembers the answer for the process: a few seconds per ISA on a small
    CPU, paid again in every new sdopt cache entry. Asked outside sdopt's routing, the probe lands in
    torch's own cache folder once per machine, and every entry after reuses the process's answer."""
    started = time.perf_counter()
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        valid_vec_isa_list()
    except Exception:  # a torch without it, or a probe that breaks: the compile asks again and reports
        return 0.0
    return time.perf_counter() - started


def _holds_graphs(inductor_dir: str) -> bool:
    """Whether inductor's FX-graph cache in ``inductor_dir`` has any graph in it."""
    try:
        with os.scandir(os.path.join(inductor_dir, "fxgraph")) as entries:
            return any(entries)
    except OSError:
        return False


def _graph_cache_lookups(counters: dict) -> tuple[int, int]:
    """(graphs inductor found in its FX-graph cache, graphs it had to compile) so far in this
    process, from torch's ``counters``."""
    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]


def signature_text(inputs: tuple) -> str:
    """The input shapes of a call, e.g. ``2x4x64x64, 2, 2x77x768, none (float32)``."""
    tensors = [t for t in inputs if t is not None]
    shapes = ", ".join("none" if t is None else "x".join(map(str, t.shape)) or "scalar" for t in inputs)
    return f"{shapes} ({str(tensors[0].dtype).removeprefix('torch.')})" if tensors else shapes


@dataclass
class ArtifactCache:
    """One sdopt cache entry: a folder per architecture, torch version and settings.

    While sdopt's compiled code runs (``torch_caches()``, ``wrap()``), torch's compiler caches are
    read and written here: inductor's FX graphs and C++/Triton kernels, Triton's cache, dynamo's
    profiles; so a new process compiles warm, and deleting the folder makes the next compile cold.
    ``artifacts.bin`` holds torch's portable artifacts (``torch.compiler.save_cache_artifacts``);
    ``meta.json`` marks the folder as sdopt's and keeps each input signature's last cold compile time.
    """

    root: Path
    key: str
    model: str
    settings: str
    compiles: dict[str, dict] = field(default_factory=dict, repr=False, compare=False)  # this process's, by signature_text
    _routing: _TorchCacheRouting | None = field(default=None, init=False, repr=False, compare=False)
    _users_dirs: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    # graphs from earlier runs: without them a compile is cold even where a graph repeated within
    # this run (a block compiled twice across a graph break) is found in the cache
    _earlier_graphs: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def for_module(cls, module: torch.nn.Module, config: CompileConfig, root: Path | None = None) -> ArtifactCache:
        arch = architecture_hash(module)
        version = torch.__version__.replace("+", "_")
        return cls(Path(root or default_cache_dir()).absolute(), f"{arch}-torch{version}-{config.settings()}", arch, config.settings())

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def torch_caches(self) -> _TorchCacheRouting:
        """A context manager: inside, torch's compiler caches are in this entry, except those whose
        variable the user set (``TORCHINDUCTOR_CACHE_DIR``: all of them; ``TRITON_CACHE_DIR``:
        Triton's). The first use marks the folder as sdopt's before torch writes into it; where it
        cannot be written, torch's caches stay where they are, with a warning."""
        if self._routing is None:
            self._users_dirs = users_cache_dirs()
            variables = {}
            if INDUCTOR_CACHE_VAR not in self._users_dirs:
                variables[INDUCTOR_CACHE_VAR] = str(self.folder)
                if TRITON_CACHE_VAR not in self._users_dirs:
                    variables[TRITON_CACHE_VAR] = str(self.folder / "triton")
            try:
                self._write_meta(self.meta())
            except OSError as error:
                warnings.warn(f"sdopt: cannot write the compile cache {self.folder} ({error}); torch's caches stay where they are")
                variables = {}
            self._routing = _TorchCacheRouting(variables)
            self._earlier_graphs = _holds_graphs(variables.get(INDUCTOR_CACHE_VAR) or os.environ.get(INDUCTOR_CACHE_VAR) or _torch_default_cache_dir())
        return self._routing

    def wrap(self, compiled: CompiledForward) -> Callable:
        """``compiled`` with every call, recompiles included, inside ``torch_caches()``; each call
        that compiles is noted under its ``signature_text``: seconds, and graphs found in the cache."""
        from torch._dynamo.utils import counters

        routing = self.torch_caches()
        stats = compiled.stats
        probes_cpu = compiled.config.kind.uses_inductor(compiled.config)

        def call(*inputs):
            if not stats.cpu_probed and probes_cpu and on_cpu(inputs):
                stats.cpu_probe_seconds, stats.cpu_probed = probe_cpu_vector_isa(), True
            compilations, seconds = stats.compilations, stats.compile_seconds
            lookups = _graph_cache_lookups(counters)
            with routing:
                output = compiled(*inputs)
            if stats.compilations > compilations:
                self._note_compile(signature_text(inputs), stats.compile_seconds - seconds, lookups, _graph_cache_lookups(counters))
            return output

        return call

    def _note_compile(self, signature: str, seconds: float, before: tuple[int, int], after: tuple[int, int]) -> None:
        hits, misses = (max(0, a - b) for a, b in zip(after, before))  # torch's tests may clear the counters
        noted = self.compiles.setdefault(signature, {"seconds": 0.0, "graphs_cached": 0, "graphs_compiled": 0})
        noted["seconds"] += seconds
        noted["graphs_cached"] += hits
        noted["graphs_compiled"] += misses

    def load(self) -> bool:
        """Hand the stored portable artifacts to torch, which writes them into its caches (here,
        inside ``torch_caches()``); True when there were some."""
        path = self.folder / ARTIFACTS
        if not path.is_file():
            return False
        with self.torch_caches():
            try:
                loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
            except Exception as error:  # a stale or truncated artifact must never stop a run: compile cold
                loaded, reason = None, str(error)
            else:
                reason = "torch could not read it"
        if loaded is None:
            warnings.warn(f"sdopt: ignoring unreadable compile cache {path}: {reason}")
            return False
        self._earlier_graphs = True
        return True

    def save(self) -> Path | None:
        """Store torch's portable artifacts and the meta. A signature compiled cold (nothing from the
        cache, or the cache held no graphs of earlier runs) records its cold time; a warm one keeps
        the cold time measured before. The folder, or None when torch had no artifacts to save."""
        saved = torch.compiler.save_cache_artifacts()
        if saved:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / (ARTIFACTS + ".partial")
            partial.write_bytes(saved[0])
            os.replace(partial, self.folder / ARTIFACTS)
        meta = self.meta()
        for signature, noted in self.compiles.items():
            kept = meta["compiles"].setdefault(signature, {})
            kept.update(last_seconds=round(noted["seconds"], 2), graphs_cached=noted["graphs_cached"], graphs_compiled=noted["graphs_compiled"])
            if noted["graphs_compiled"] and (not noted["graphs_cached"] or not self._earlier_graphs):
                kept["cold_seconds"] = kept["last_seconds"]
        self._write_meta(meta)
        return self.folder if saved else None

    def meta(self) -> dict:
        """The entry's meta.json, or a new one with this entry's mark, names and the time."""
        meta = _entry_meta(self.folder) or {
            "written_by": WRITTEN_BY, "key": self.key, "model": self.model, "torch": torch.__version__,
            "settings": self.settings, "created": _timestamp(), "compiles": {},
        }
        meta["last_used"] = _timestamp()
        return meta

    def _write_meta(self, meta: dict) -> None:
        """Written whole or not at all: a half-written meta.json would leave the folder unmarked."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (META + ".partial")
        partial.write_text(json.dumps(meta, indent=2))
        os.replace(partial, self.folder / META)

    def note(self) -> str:
        """What this process's compiles found in the cache, per input signature, with the cold
        compile time of the same signature where one was measured; and where torch's caches are
        when the user's variables put them elsewhere."""
        kept = (_entry_meta(self.folder) or {}).get("compiles", {})
        here = self._routing is not None and INDUCTOR_CACHE_VAR in self._routing.variables
        where = "sdopt's compile cache" if here else "inductor's cache"
        parts = []
        for signature, noted in self.compiles.items():
            cached, compiled, took = noted["graphs_cached"], noted["graphs_compiled"], f"{noted['seconds']:.1f} s"
            cold = kept.get(signature, {}).get("cold_seconds")
            was = f"; its cold compile took {cold:.1f} s" if cold else "; no cold compile of these inputs on record"
            if not cached and not compiled:
                parts.append(f"compiled inputs {signature} in {took} (no graph went through inductor's cache)")
            elif not self._earlier_graphs:
                parts.append(f"cold compile of inputs {signature}: {took}, {where} held no graphs before this run")
            elif not cached:
                parts.append(f"cold compile of inputs {signature}: {took}, none of its {compiled} graph(s) in {where}")
            elif not compiled:
                parts.append(f"warm compile of inputs {signature}: {took}, all {cached} graph(s) from {where}{was}")
            else:
                parts.append(f"partly warm compile of inputs {signature}: {took}, {cached} of {cached + compiled} graph(s) from {where}{was}")
        if INDUCTOR_CACHE_VAR in self._users_dirs:
            parts.append(f"torch's caches are in {INDUCTOR_CACHE_VAR}={self._users_dirs[INDUCTOR_CACHE_VAR]} "
                         "(set in the environment), which `python -m sdopt cache purge` leaves alone")
        elif TRITON_CACHE_VAR in self._users_dirs:
            parts.append(f"Triton's cache is in {TRITON_CACHE_VAR}={self._users_dirs[TRITON_CACHE_VAR]} "
                         "(set in the environment), which `python -m sdopt cache purge` leaves alone")
        return "; ".join(parts)


def _entry_meta(folder: Path) -> dict | None:
    """The meta.json of a folder sdopt's cache wrote, or None for anything else (a link, a file,
    a folder without sdopt's mark or whose mark names another key)."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return None
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("written_by") != WRITTEN_BY or meta.get("key") != folder.name:
        return None
    meta.setdefault("compiles", {})
    return meta


def _folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file torch removes while this counts
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def _items(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except OSError:  # no such folder, or not a folder
        return []


def cache_entries(root: Path | None = None) -> list[dict]:
    """The entries sdopt wrote under ``root``: their meta.json fields and ``bytes`` on disk,
    torch's cache files included."""
    entries = []
    for item in _items(Path(root or default_cache_dir())):
        meta = _entry_meta(item)
        if meta is not None:
            entries.append({**meta, "bytes": _folder_bytes(item)})
    return entries


def foreign_items(root: Path | None = None) -> list[str]:
    """The names under ``root`` that are not sdopt cache entries: never listed, never purged."""
    return [item.name for item in _items(Path(root or default_cache_dir())) if _entry_meta(item) is None]


def purge_cache(root: Path | None = None, key: str | None = None) -> list[str]:
    """Delete every sdopt entry under ``root`` (or the one named ``key``), and nothing else;
    returns the keys deleted."""
    root = Path(root or default_cache_dir())
    doomed = [entry["key"] for entry in cache_entries(root) if key is None or entry["key"] == key]
    for name in doomed:
        shutil.rmtree(root / name)
    return doomed
