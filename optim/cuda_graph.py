"""CUDA graph capture and replay of a tensor function, one graph per input signature.

``GraphedFunction(fn, weights)`` captures ``fn`` the first time it sees an input signature
(shapes, dtypes, devices, inference mode) together with the identity of the weights it reads
(their addresses and dtypes), then replays that graph: each call copies its tensors into the
graph's static input buffers, so per-step values (timestep, conditioning) are never baked in, and
returns a clone of the static output, which the next replay overwrites. Graphs share one private
memory pool and are bounded by an LRU. When the weights are replaced (a LoRA patched or unpatched,
a reload, a dtype change) every graph that read the old ones is dropped and recaptured on demand.
Inputs a graph cannot serve (CPU tensors, weights not all on the GPU, a failed capture) run eagerly,
and ``stats`` says why.

The capture backend is pluggable so that the bookkeeping can be tested without a GPU.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import Unavailable

Signature = tuple


@dataclass(frozen=True)
class GraphConfig:
    max_graphs: int = 4
    warmup_runs: int = 2

    def __post_init__(self):
        if self.max_graphs < 1:
            raise ValueError("max_graphs must be at least 1")
        if self.warmup_runs < 1:
            raise ValueError("warmup_runs must be at least 1: the first runs allocate lazily and compile")


@dataclass
class Captured:
    static_inputs: tuple
    static_output: Any
    replay: Callable[[], None]


class CaptureBackend(Protocol):
    def capture(self, fn: Callable, static_inputs: tuple, warmup_runs: int) -> Captured: ...


class CUDACaptureBackend:
    """``torch.cuda.CUDAGraph`` capture after warm-up runs on a side stream, in one private pool.

    Capture records kernels without running them: the caller replays once to get the first output.
    """

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable, static_inputs: tuple, warmup_runs: int) -> Captured:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn(*static_inputs)
        return Captured(static_inputs, output, graph.replay)


def unavailable(config: GraphConfig, device: torch.device) -> Unavailable | None:
    """Why CUDA graphs cannot run on ``device``, with the fix, or None when they can."""
    if device.type != "cuda":
        return Unavailable(f"CUDA graphs need a CUDA device; this model runs on {device.type}", "run the model on a CUDA GPU")
    if not torch.cuda.is_available():
        return Unavailable("CUDA graphs need CUDA, and torch.cuda is not available", "install a CUDA build of torch")
    return None


def weight_identity(tensors: Iterable[torch.Tensor]) -> tuple:
    """Where each weight lives and in what dtype: a captured graph reads exactly these addresses."""
    return tuple([(t.data_ptr(), t.dtype, t.device) for t in tensors])


def module_weights(module: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
    """The parameters and buffers of ``module``, re-read on each call from the slots that hold them,
    so a replaced parameter (a LoRA patched in by ``setattr``) is seen. The tree is walked once:
    walking it for every step costs about a millisecond of Python on a UNet, which a graph replay
    of a few milliseconds cannot hide."""
    slots = [
        (tensors, name)
        for m in module.modules()
        for tensors in (m._parameters, m._buffers)
        for name, t in tensors.items()
        if t is not None
    ]
    return lambda: [tensors[name] for tensors, name in slots]


def input_signature(inputs: tuple) -> Signature:
    return tuple(
        None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs
    ) + (torch.is_inference_mode_enabled(),)


def _map_tensors(fn: Callable, value):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    invalidations: int = 0
    evictions: int = 0
    capture_seconds: float = 0.0
    eager_reasons: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        text = (
            f"{self.captures} capture(s) in {self.capture_seconds:.2f} s, {self.replays} replay(s), "
            f"{self.invalidations} invalidated by a weight change, {self.evictions} evicted"
        )
        if self.eager_calls:
            reasons = "; ".join(f"{reason} ({n}x)" for reason, n in self.eager_reasons.items())
            text += f", {self.eager_calls} eager call(s): {reasons}"
        return text


class GraphedFunction:
    """``fn`` replayed from CUDA graphs, one per input signature and weight identity (LRU-bounded).

    ``weights`` returns the tensors ``fn`` reads besides its inputs; ``extra_key`` adds what their
    addresses cannot show (e.g. a host's patch version for weights updated in place by a copy that
    a frozen artifact would not see). ``eager_reason(inputs)`` may veto capture for a call.
    """

    def __init__(
        self,
        fn: Callable,
        weights: Callable[[], Iterable[torch.Tensor]],
        config: GraphConfig = GraphConfig(),
        backend: CaptureBackend | None = None,
        extra_key: Callable[[], Any] = lambda: None,
    ):
        self.fn = fn
        self.weights = weights
        self.config = config
        self.backend = backend
        self.extra_key = extra_key
        self.graphs: OrderedDict[Signature, Captured] = OrderedDict()
        self.failed: dict[Signature, str] = {}
        self.weights_key = None
        self.stats = GraphStats()

    def _eager(self, reason: str, inputs: tuple):
        self.stats.eager_calls += 1
        self.stats.eager_reasons[reason] += 1
        return self.fn(*inputs)

    def _blocking_reason(self, inputs: tuple, identity: tuple) -> str | None:
        devices = {t.device for t in inputs if t is not None}
        if len(devices) != 1:
            return "inputs on several devices" if devices else "no tensor inputs"
        (device,) = devices
        if self.backend is None:
            problem = unavailable(self.config, device)
            reason = problem.reason if problem else None
            if reason:
                return reason
        if {weight_device for _, _, weight_device in identity} - {device}:
            return "weights not all on the input device (partially loaded or offloaded model)"
        return None

    def __call__(self, *inputs):
        identity = weight_identity(self.weights())
        reason = self._blocking_reason(inputs, identity)
        if reason:
            return self._eager(reason, inputs)
        weights_key = (identity, self.extra_key())
        if weights_key != self.weights_key:
            if self.graphs:
                self.stats.invalidations += len(self.graphs)
            self.graphs.clear()
            if isinstance(self.backend, CUDACaptureBackend):
                self.backend = CUDACaptureBackend()  # a pool whose graphs are all gone cannot take new ones
            self.failed.clear()
            self.weights_key = weights_key
        signature = input_signature(inputs)
        if signature in self.failed:
            return self._eager(self.failed[signature], inputs)
        entry = self.graphs.get(signature)
        if entry is None:
            entry = self._capture(signature, inputs)
            if entry is None:
                return self._eager(self.failed[signature], inputs)
        else:
            self.graphs.move_to_end(signature)
            for static, value in zip(entry.static_inputs, inputs):
                if static is not None:
                    static.copy_(value)
        entry.replay()
        self.stats.replays += 1
        return _map_tensors(torch.Tensor.clone, entry.static_output)

    def _capture(self, signature: Signature, inputs: tuple) -> Captured | None:
        if self.backend is None:
            self.backend = CUDACaptureBackend()
        static_inputs = tuple(None if t is None else t.clone() for t in inputs)
        started = time.perf_counter()
        try:
            entry = self.backend.capture(self.fn, static_inputs, self.config.warmup_runs)
        except Exception as error:  # capture rejects many ops (host syncs, CPU copies); run those eagerly
            self.failed[signature] = f"capture failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return None
        self.stats.capture_seconds += time.perf_counter() - started
        self.stats.captures += 1
        self.graphs[signature] = entry
        while len(self.graphs) > self.config.max_graphs:
            self.graphs.popitem(last=False)
            self.stats.evictions += 1
        return entry
