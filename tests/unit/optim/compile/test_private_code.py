"""Private code copies: forwards over one function keep their own entries, limit and reasons; a
compiled model that is gone leaves nothing of itself in the process."""
import gc
import weakref

import pytest
import torch

from sdopt.optim.compile import CompileConfig, compile_forward
from sdopt.optim.compile import private_code
from .support import Widening


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
        private_code.sweep_dead_guards()  # what the next compile would do first

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
