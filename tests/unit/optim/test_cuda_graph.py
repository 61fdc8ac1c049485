"""GraphedFunction bookkeeping on a CPU, through a backend that replays the way a CUDA graph does.

``RerunBackend`` reruns the function on the static inputs, with the weight tensors that existed at
capture, into the output buffers of the capture: a graph reads fixed addresses and overwrites fixed
buffers, so aliasing and stale-weight bugs show up here as they would on a GPU.
"""
import contextlib

import pytest
import torch

from sdopt.optim.cuda_graph import GraphConfig, GraphedFunction, module_weights, unavailable
from sdopt.optim.cuda_graph import Captured


@contextlib.contextmanager
def weights_bound(module: torch.nn.Module, params: dict):
    current = dict(module.named_parameters())
    def put(values):
        for name, value in values.items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, value)
    put(params)
    try:
        yield
    finally:
        put(current)


class RerunBackend:
    def __init__(self, module):
        self.module = module
        self.fail_with = None

    def capture(self, fn, static_inputs, warmup_runs):
        if self.fail_with:
            raise self.fail_with
        for _ in range(warmup_runs):
            fn(*static_inputs)
        captured_weights = dict(self.module.named_parameters())
        output = fn(*static_inputs)
        output.fill_(float("nan"))  # capture runs no kernels: the buffer holds nothing yet

        def replay():
            with weights_bound(self.module, captured_weights):
                output.copy_(fn(*static_inputs))

        return Captured(static_inputs, output, replay)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.proj = torch.nn.Linear(5, 4)

    def forward(self, x, t, context):
        return self.conv(x) * t[:, None, None, None] + self.proj(context).mean(1)[:, :, None, None]


def graphed(net, **config):
    backend = RerunBackend(net)
    return GraphedFunction(net, module_weights(net), GraphConfig(**config), backend=backend), backend


def inputs(size=8, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.rand(batch, generator=g), torch.randn(batch, 7, 5, generator=g)


EXACT = dict(rtol=0, atol=0)


@torch.inference_mode()
def test_replay_equals_eager_and_returned_outputs_are_not_overwritten():
    net = Net()
    fn, _ = graphed(net)
    first_inputs, second_inputs = inputs(seed=1), inputs(seed=2)
    first = fn(*first_inputs)
    torch.testing.assert_close(first, net(*first_inputs), **EXACT)
    kept = first.clone()
    second = fn(*second_inputs)
    torch.testing.assert_close(second, net(*second_inputs), **EXACT)
    torch.testing.assert_close(first, kept, **EXACT)
    assert fn.stats.captures == 1 and fn.stats.replays == 2


@torch.inference_mode()
def test_a_new_shape_captures_once_and_is_reused():
    net = Net()
    fn, _ = graphed(net)
    for size in (8, 16, 8, 16, 16):
        out = fn(*inputs(size))
        torch.testing.assert_close(out, net(*inputs(size)), **EXACT)
    assert fn.stats.captures == 2


@torch.inference_mode()
def test_the_number_of_graphs_is_bounded_least_recently_used_first():
    net = Net()
    fn, _ = graphed(net, max_graphs=2)
    for size in (8, 16, 24):
        fn(*inputs(size))
    assert len(fn.graphs) == 2 and fn.stats.evictions == 1
    fn(*inputs(24))
    assert fn.stats.captures == 3
    torch.testing.assert_close(fn(*inputs(8)), net(*inputs(8)), **EXACT)
    assert fn.stats.captures == 4


@torch.inference_mode()
def test_replaced_weights_invalidate_the_graphs():
    net = Net()
    fn, _ = graphed(net)
    fn(*inputs())
    net.conv.weight = torch.nn.Parameter(torch.randn_like(net.conv.weight))
    torch.testing.assert_close(fn(*inputs()), net(*inputs()), **EXACT)
    assert fn.stats.invalidations == 1 and fn.stats.captures == 2


@torch.inference_mode()
def test_weights_updated_in_place_are_read_at_replay_without_recapture():
    net = Net()
    fn, _ = graphed(net)
    fn(*inputs())
    net.proj.weight.mul_(3)
    torch.testing.assert_close(fn(*inputs()), net(*inputs()), **EXACT)
    assert fn.stats.captures == 1


@torch.inference_mode()
def test_a_dtype_change_invalidates():
    net = Net()
    fn, _ = graphed(net)
    fn(*inputs())
    net.double()
    x, t, c = inputs()
    torch.testing.assert_close(fn(x.double(), t.double(), c.double()), net(x.double(), t.double(), c.double()), **EXACT)
    assert fn.stats.captures == 2


@torch.inference_mode()
def test_a_failed_capture_runs_eagerly_and_says_why_once():
    net = Net()
    fn, backend = graphed(net)
    backend.fail_with = RuntimeError("operation not permitted when stream is capturing")
    for _ in range(2):
        torch.testing.assert_close(fn(*inputs()), net(*inputs()), **EXACT)
    assert fn.stats.eager_calls == 2 and fn.stats.captures == 0
    assert "capture failed: RuntimeError: operation not permitted" in fn.stats.summary()


@torch.inference_mode()
def test_without_cuda_the_default_backend_runs_eagerly():
    net = Net()
    fn = GraphedFunction(net, net.parameters)
    torch.testing.assert_close(fn(*inputs()), net(*inputs()), **EXACT)
    assert fn.stats.eager_reasons == {unavailable(GraphConfig(), torch.device("cpu")).reason: 1}


def test_module_weights_reread_replaced_parameters_and_buffers():
    net = torch.nn.Sequential(Net(), torch.nn.BatchNorm1d(4))
    weights = module_weights(net)
    assert sorted(map(id, weights())) == sorted(map(id, [*net.parameters(), *net.buffers()]))
    new = torch.nn.Parameter(net[0].conv.weight * 2)
    net[0].conv.weight = new
    assert any(t is new for t in weights())
    net[1].running_mean = torch.ones(4)
    assert any(t is net[1].running_mean for t in weights())


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_graphs"):
        GraphConfig(max_graphs=0)
