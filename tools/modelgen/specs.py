"""What a checkpoint tensor is before it is written: its shape and initial distribution (``TensorSpec``),
the builder that lays out a module's tensors (``SpecBuilder``), and the tensor itself, a function of
(seed, key) only (``generate_tensor``)."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Std of everything that is not a conv/linear weight or a norm scale: biases, embeddings, norm shifts.
SMALL_STD = 0.02


@dataclass(frozen=True)
class TensorSpec:
    """Shape and initial distribution, normal(mean, std), of one checkpoint tensor."""

    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SpecBuilder:
    """Collects TensorSpecs by module, so each layer's keys and inits are written once."""

    def __init__(self) -> None:
        self.specs: dict[str, TensorSpec] = {}

    def _weight(self, name: str, shape: tuple[int, ...]) -> None:
        # std 1/sqrt(fan_in) keeps activations near unit scale layer after layer, so
        # even the full-depth networks stay finite in fp16.
        self.specs[f"{name}.weight"] = TensorSpec(shape, std=math.prod(shape[1:]) ** -0.5)

    def _bias(self, name: str, channels: int) -> None:
        self.specs[f"{name}.bias"] = TensorSpec((channels,), std=SMALL_STD)

    def conv(self, name: str, out_channels: int, in_channels: int, kernel: int) -> None:
        self._weight(name, (out_channels, in_channels, kernel, kernel))
        self._bias(name, out_channels)

    def linear(self, name: str, out_features: int, in_features: int, bias: bool = True) -> None:
        self._weight(name, (out_features, in_features))
        if bias:
            self._bias(name, out_features)

    def norm(self, name: str, channels: int) -> None:
        # Scales near 1 and shifts near 0, but not exactly: equivalence tests of fused
        # norms should fail if the affine parameters are dropped.
        self.specs[f"{name}.weight"] = TensorSpec((channels,), std=SMALL_STD, mean=1.0)
        self._bias(name, channels)

    def embedding(self, name: str, count: int, dim: int) -> None:
        self.specs[f"{name}.weight"] = TensorSpec((count, dim), std=SMALL_STD)

    def scale(self, name: str, factor: float) -> None:
        """Multiply the weight and bias of module ``name`` by ``factor``."""
        for key in (f"{name}.weight", f"{name}.bias"):
            spec = self.specs[key]
            self.specs[key] = TensorSpec(spec.shape, std=spec.std * factor, mean=spec.mean * factor)


def param_count(specs: dict[str, TensorSpec]) -> int:
    return sum(spec.numel for spec in specs.values())


def generate_tensor(key: str, spec: TensorSpec, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor stored under ``key``: a function of (seed, key) only, not of the other keys.

    Values are drawn in fp32 and then cast, so an fp16 checkpoint equals the fp32 one
    cast to fp16.
    """
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    values = torch.randn(spec.shape, generator=generator).mul_(spec.std).add_(spec.mean)
    return values.to(dtype)
