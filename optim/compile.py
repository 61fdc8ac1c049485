"""Compiled forwards: ``torch.compile`` whole or by repeated block, or ``torch.jit.trace``.

``compile_forward(module, call, CompileConfig(...))`` returns a ``CompiledForward`` whose
``__call__(*tensors)`` equals ``call(module, *tensors)``. The caller passes tensors only, so per-step
Python values (step count, sigmas, CFG scale) never reach a guard: a new input signature compiles
once, and every other change runs the cached code. Weights stay inputs in every mode:

- ``compile``: dynamo lifts parameters to graph inputs, so replaced weights are read, not baked in;
- ``compile_regional``: each block class that repeats is compiled once and shared by its
  instances (their ``forward`` is bound to the compiled one only while the call runs);
- ``trace``: one trace per input signature; replaced weights are rebound into the trace, and with
  ``freeze`` (weights folded in as constants) the trace is redone, which the stats say.

The first call of each input signature runs eagerly, so lazy set-up in the module stays out of the
compiled code. ``stats`` counts compilations with their time and dynamo's guard-failure reasons.
``ArtifactCache`` keeps torch's own compiler artifacts (``torch.compiler.save_cache_artifacts``)
in a folder per architecture, torch version and settings, so a new process compiles warm.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cuda_graph import input_signature

MODES = ("compile", "compile_regional", "trace")
BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ARTIFACTS = "artifacts.bin"
META = "meta.json"


@dataclass(frozen=True)
class CompileConfig:
    mode: str = "compile"
    backend: str = "inductor"
    compile_mode: str = "default"
    dynamic: bool = False
    fullgraph: bool = False
    freeze: bool = False
    max_traces: int = 4

    def __post_init__(self):
        for name, value, allowed in (("mode", self.mode, MODES), ("backend", self.backend, BACKENDS), ("compile_mode", self.compile_mode, COMPILE_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")

    def torch_compile_kwargs(self) -> dict:
        return {
            "backend": self.backend,
            "mode": None if self.compile_mode == "default" or self.backend != "inductor" else self.compile_mode,
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
        }

    def settings(self) -> str:
        if self.mode == "trace":
            return f"trace{'-freeze' if self.freeze else ''}"
        return f"{self.mode}-{self.backend}-{self.compile_mode}{'-dynamic' if self.dynamic else ''}{'-fullgraph' if self.fullgraph else ''}"


def unavailable_reason(config: CompileConfig, device: torch.device) -> str | None:
    """Why ``config`` cannot run on ``device`` here, or None when it can."""
    if config.mode == "trace":
        return None
    if config.backend == "inductor":
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return "inductor on CUDA needs Triton (pip install triton)"
        if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return "inductor on a CPU needs a C++ compiler (g++ or clang++)"
    if config.backend == "cudagraphs" and device.type != "cuda":
        return f"the cudagraphs backend needs a CUDA device; this model runs on {device.type}"
    return None


def nchw_conv_weight_bytes(module: torch.nn.Module, config: CompileConfig) -> int:
    """Bytes of 2-D conv weights that inductor copies to channels-last on every call: it lays such
    convolutions out channels-last (its layout optimization) and the weights are graph inputs, so
    weights stored NCHW are converted each time. Stored channels-last, they are used as they are."""
    if config.mode == "trace" or config.backend != "inductor":
        return 0
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    return sum(w.numel() * w.element_size() for w in weights if not w.is_contiguous(memory_format=torch.channels_last))


# --- compile accounting: dynamo's callbacks, attributed to the forward that is running ----------


@dataclass
class CompileStats:
    compilations: int = 0
    compile_seconds: float = 0.0
    recompile_reasons: list[str] = field(default_factory=list)
    weight_rebinds: int = 0
    signatures: set = field(default_factory=set)

    @property
    def cache_entries(self) -> int:
        """Input signatures that needed compiling: a new resolution adds one, anything else none."""
        return len(self.signatures)

    def summary(self) -> str:
        text = f"{self.cache_entries} input signature(s), {self.compilations} compilation(s) in {self.compile_seconds:.1f} s"
        if self.recompile_reasons:
            text += "; recompiled because: " + " | ".join(dict.fromkeys(self.recompile_reasons))
        if self.weight_rebinds:
            text += f"; new weights bound {self.weight_rebinds} time(s) without recompiling"
        return text


_running: list[CompileStats] = []
_started: dict = {}


def _compile_id(args: tuple):
    return getattr(args[0], "compile_id", None) if args else None


def _on_compile_start(*args, **_kwargs):
    if _running:
        _running[-1].compilations += 1
        _started[_compile_id(args)] = (_running[-1], time.perf_counter())


def _on_compile_end(*args, **_kwargs):
    stats, started = _started.pop(_compile_id(args), (None, 0.0))
    if stats is not None:
        stats.compile_seconds += time.perf_counter() - started


def _install_callbacks() -> None:
    from torch._dynamo import callback_handler

    if _on_compile_start not in callback_handler.start_callbacks:  # torch._dynamo.reset() clears them
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)


def _guard_failure_count() -> int:
    from torch._dynamo.utils import guard_failures

    return sum(len(reasons) for reasons in guard_failures.values())


def _new_guard_failures(before: int) -> list[str]:
    from torch._dynamo.utils import guard_failures

    every = [reason for reasons in guard_failures.values() for reason in reasons]
    return [str(reason).split(". ")[0] for reason in every[before:]]


@contextlib.contextmanager
def accounted(stats: CompileStats):
    """Attribute the compilations that happen inside to ``stats``."""
    _install_callbacks()
    before = _guard_failure_count()
    _running.append(stats)
    try:
        yield
    finally:
        _running.pop()
        stats.recompile_reasons.extend(_new_guard_failures(before))


# --- the three modes ----------------------------------------------------------------------------


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost composite blocks whose class occurs at least twice (torch.nn containers excluded)."""
    counts: dict[type, int] = {}
    for sub in module.modules():
        counts[type(sub)] = counts.get(type(sub), 0) + 1

    def is_block(sub):
        cls = type(sub)
        return (
            counts[cls] > 1
            and any(True for _ in sub.children())
            and not isinstance(sub, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))
            and not cls.__module__.startswith("torch.")
        )

    chosen = []

    def walk(sub):
        for child in sub.children():
            if is_block(child):
                chosen.append(child)
            else:
                walk(child)

    walk(module)
    return chosen


class _Traceable(torch.nn.Module):
    """``call(module, *inputs)`` with the ``None`` inputs fixed, since a trace takes tensors only."""

    def __init__(self, module: torch.nn.Module, call: Callable, inputs: tuple):
        super().__init__()
        self.module = module
        self.call = call
        self.layout = tuple(t is None for t in inputs)

    def forward(self, *tensors):
        given = iter(tensors)
        return self.call(self.module, *(None if missing else next(given) for missing in self.layout))


def _named_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _rebind(script_module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = script_module.module
    for part in owner.split(".") if owner else ():
        target = getattr(target, part)
    setattr(target, leaf, value)


class CompiledForward:
    """``call(module, *inputs)`` through the compiled artifact of ``config.mode``."""

    def __init__(self, module: torch.nn.Module, call: Callable, config: CompileConfig):
        self.module = module
        self.call = call
        self.config = config
        self.stats = CompileStats()
        self.seen: set = set()
        self.traces: OrderedDict[tuple, tuple[torch.jit.ScriptModule, dict]] = OrderedDict()
        if config.mode == "compile":
            self._compiled = torch.compile(functools.partial(call, module), **config.torch_compile_kwargs())
        elif config.mode == "compile_regional":
            self.blocks = repeated_blocks(module)
            shared: dict[type, Callable] = {}
            for block in self.blocks:
                if type(block) not in shared:
                    shared[type(block)] = torch.compile(type(block).forward, **config.torch_compile_kwargs())
            self._block_forwards = [(block, shared[type(block)]) for block in self.blocks]

    def __call__(self, *inputs):
        signature = input_signature(inputs)
        if signature not in self.seen:
            # Lazy Python-side set-up in the module (per-shape attention decisions, records, caches)
            # runs eagerly once, so the compiled code only meets its steady path and needs no graph break.
            self.seen.add(signature)
            return self.call(self.module, *inputs)
        compilations = self.stats.compilations
        try:
            return self._run(inputs)
        finally:
            if self.stats.compilations > compilations:
                self.stats.signatures.add(signature)

    def _run(self, inputs: tuple):
        with accounted(self.stats):
            if self.config.mode == "compile":
                return self._compiled(*inputs)
            if self.config.mode == "compile_regional":
                with self._blocks_compiled():
                    return self.call(self.module, *inputs)
            return self._traced(inputs)(*(t for t in inputs if t is not None))

    @contextlib.contextmanager
    def _blocks_compiled(self):
        for block, compiled in self._block_forwards:
            block.forward = functools.partial(compiled, block)
        try:
            yield
        finally:
            for block, _ in self._block_forwards:
                del block.forward

    def _traced(self, inputs: tuple):
        signature = input_signature(inputs)
        state = _named_state(self.module)
        if signature in self.traces:
            traced, bound = self.traces[signature]
            self.traces.move_to_end(signature)
            changed = [name for name, value in state.items() if bound.get(name) is not value]
            if not changed:
                return traced
            if not self.config.freeze:
                for name in changed:
                    _rebind(traced, name, state[name])
                    bound[name] = state[name]
                self.stats.weight_rebinds += 1
                return traced
            self.stats.recompile_reasons.append("weights changed and a frozen trace holds them as constants")
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            tensors = tuple(t for t in inputs if t is not None)
            traced = torch.jit.trace(_Traceable(self.module, self.call, inputs), tensors, check_trace=False)
            if self.config.freeze:
                traced = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
        self.stats.compilations += 1
        self.stats.compile_seconds += time.perf_counter() - started
        self.traces[signature] = (traced, state)
        while len(self.traces) > self.config.max_traces:
            self.traces.popitem(last=False)
        return traced


def compile_forward(module: torch.nn.Module, call: Callable, config: CompileConfig = CompileConfig()) -> CompiledForward:
    return CompiledForward(module, call, config)


# --- persistent artifacts -----------------------------------------------------------------------


def default_cache_dir() -> Path:
    if os.environ.get("SDOPT_CACHE_DIR"):
        return Path(os.environ["SDOPT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdopt" / "compile"


def architecture_hash(module: torch.nn.Module) -> str:
    """A hash of the module's class and tensor names, shapes, strides and dtypes: compiled code
    depends on these (the strides say which weights are channels-last), not on the weight values,
    which stay inputs."""
    digest = hashlib.sha256(type(module).__qualname__.encode())
    for name, tensor in _named_state(module).items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.stride()}:{tensor.dtype}".encode())
    return digest.hexdigest()[:16]


@dataclass
class ArtifactCache:
    """torch's compiler artifacts for one architecture, torch version and settings."""

    root: Path
    key: str
    model: str
    settings: str

    @classmethod
    def for_module(cls, module: torch.nn.Module, config: CompileConfig, root: Path | None = None) -> ArtifactCache:
        arch = architecture_hash(module)
        version = torch.__version__.replace("+", "_")
        return cls(Path(root or default_cache_dir()), f"{arch}-torch{version}-{config.settings()}", arch, config.settings())

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def load(self) -> bool:
        """Hand the stored artifacts to torch; True when there were some (a warm compile follows)."""
        path = self.folder / ARTIFACTS
        if not path.is_file():
            return False
        try:
            loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
        except Exception as error:  # a stale or truncated artifact must never stop a run: compile cold
            loaded, reason = None, str(error)
        else:
            reason = "torch could not read it"
        if loaded is None:
            warnings.warn(f"sdopt: ignoring unreadable compile cache {path}: {reason}")
            return False
        return True

    def save(self, compile_seconds: float) -> Path | None:
        saved = torch.compiler.save_cache_artifacts()
        if not saved:
            return None
        payload = saved[0]
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (ARTIFACTS + ".partial")
        partial.write_bytes(payload)
        os.replace(partial, self.folder / ARTIFACTS)
        meta = {"model": self.model, "torch": torch.__version__, "settings": self.settings, "bytes": len(payload), "cold_compile_seconds": round(compile_seconds, 2), "saved": time.strftime("%Y-%m-%dT%H:%M:%S")}
        previous = self._meta()
        if previous.get("cold_compile_seconds"):
            meta["cold_compile_seconds"] = previous["cold_compile_seconds"]
        (self.folder / META).write_text(json.dumps(meta, indent=2))
        return self.folder

    def _meta(self) -> dict:
        path = self.folder / META
        return json.loads(path.read_text()) if path.is_file() else {}

    def cold_compile_seconds(self) -> float | None:
        return self._meta().get("cold_compile_seconds")


def cache_entries(root: Path | None = None) -> list[dict]:
    root = Path(root or default_cache_dir())
    entries = []
    for folder in sorted(root.glob("*")) if root.is_dir() else []:
        meta_path = folder / META
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        entries.append({"key": folder.name, "bytes": size, **{k: v for k, v in meta.items() if k != "bytes"}})
    return entries


def purge_cache(root: Path | None = None, key: str | None = None) -> list[str]:
    """Delete every entry (or the one named ``key``); returns the keys deleted."""
    root = Path(root or default_cache_dir())
    doomed = [entry["key"] for entry in cache_entries(root) if key is None or entry["key"] == key]
    for name in doomed:
        shutil.rmtree(root / name)
    return doomed

