"""What the compile tests share: the tiny UNet's call and inputs, the tolerances, and small modules
that widen per block or break torch.compile's graph.

Tolerances: the eager and aot_eager backends run the same kernels, so they match exactly up to
float32 reordering (2e-5); inductor fuses and reorders reductions (1e-4 relative on fp32).
"""
import os

import torch


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
