"""What torch did, in the record: graph breaks and the functions it gave up on, with reason and fix;
its recompile-limit warning; graphs made by an earlier compile, counted with their owner."""
import logging
import types

import pytest
import torch

from sdopt.optim.compile import CompileConfig, CompileStats, compile_forward
from sdopt.optim.compile import accounting, forward as forward_module
from .support import CallsAFileReader, reads_a_file


def test_a_graph_break_and_the_function_torch_gave_up_on_are_named_with_reason_and_fix():
    module = CallsAFileReader()
    fast = compile_forward(module, lambda m, x: m(x), CompileConfig(backend="eager"))
    x = torch.randn(2, 4)
    fast(x)
    torch.testing.assert_close(fast(x), module(x))
    stats = fast.stats
    ((reason, functions),) = stats.graph_breaks.items()
    assert "`open`" in reason and "\n" not in reason
    assert functions[0].startswith("reads_a_file (support.py:"), "the function with the untraceable call comes first"
    assert not any(name.startswith("forward (modes.py") for name in functions), "sdopt's own wrapper is not named"
    assert any(gave_up.function.startswith("reads_a_file") for gave_up in stats.gave_up.values()), stats.gave_up
    details = "; ".join(stats.details())
    assert f"graph break ({reason}) in reads_a_file" in details and accounting.GRAPH_BREAK_FIX in details
    assert "torch gave up on" in details and accounting.EAGER_FRAME_FIX in details
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
    with accounting.accounted(stats):
        warn("torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s\nTo log all recompilation reasons, use "
             'TORCH_LOGS="recompiles".', "recompile_limit", 8,
             "'torch_dynamo_resume_in_attention_sub_quad_at_234' (/comfy/ldm/modules/attention.py:234)",
             "17/7: tensor 'key' size mismatch at index 2. expected 77, actual 16")
    warn("torch._dynamo hit config.%s (%s)\n   function: %s\n", "recompile_limit", 8, "'outside' (/x.py:1)")  # no compile accounted
    (gave_up,) = stats.gave_up.values()
    assert gave_up.function == "attention_sub_quad (attention.py:234)"
    assert gave_up.reason == "hit torch's recompile_limit (8); last recompile because tensor 'key' size mismatch at index 2. expected 77, actual 16"
    assert gave_up.fix == accounting.RECOMPILE_LIMIT_FIX
    assert "torch gave up on attention_sub_quad (attention.py:234) (hit torch's recompile_limit (8)" in stats.details()[0]
    assert stats.shortfall() == "1 function(s) ran eagerly (attention_sub_quad (attention.py:234))"


def test_compilation_metrics_file_breaks_and_eager_frames_but_leave_the_limit_to_its_warning():
    """Faked: torch's CompilationMetrics of a split frame, a frame it gave up on, and a recompile-limit hit."""
    def metric(co_name, restart=(), fail_type=None, fail_reason=None):
        return types.SimpleNamespace(co_name=co_name, co_filename="/comfy/attention.py" if co_name else None, co_firstlineno=7,
                                     restart_reasons=set(restart), fail_type=fail_type, fail_reason=fail_reason)

    stats = CompileStats()
    unsupported = "Failed to trace builtin operator\n  Explanation: Dynamo does not know how to trace `open`. More.\n  Hint: avoid it"
    accounting.note_metric(stats, metric("forward", restart=[unsupported]))
    accounting.note_metric(stats, metric("torch_dynamo_resume_in_get_free_memory_at_1265", restart=[unsupported]))
    accounting.note_metric(stats, metric("wrapper", fail_type="Unsupported", fail_reason=unsupported))
    accounting.note_metric(stats, metric(None, fail_type="Unsupported", fail_reason="Dynamo recompile limit exceeded"))
    reason = "Failed to trace builtin operator: Dynamo does not know how to trace `open`"
    assert stats.graph_breaks == {reason: ["get_free_memory (attention.py:7)", "forward (attention.py:7)"]}
    assert list(stats.gave_up) == ["wrapper (attention.py:7)"]
    assert stats.gave_up["wrapper (attention.py:7)"].reason == reason


def test_graph_break_reasons_tell_a_whole_graph_from_a_broken_one():
    x = torch.randn(3)
    assert forward_module.graph_break_reasons(lambda t: torch.nn.functional.gelu(t) * 2, x) == []
    reasons = forward_module.graph_break_reasons(reads_a_file, x)
    assert reasons and "`open`" in reasons[0]


def test_each_compiled_model_keeps_the_pieces_a_graph_break_leaves_outside():
    """Where torch isolates recompiles, a second model compiles its own pieces and reuses nothing."""
    if not forward_module.isolated_recompiles():
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
    monkeypatch.setattr(forward_module, "isolated_recompiles", lambda: {})
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
