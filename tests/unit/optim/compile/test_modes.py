"""The three modes as objects: each mode's attributes and record wording, a config's ``kind`` as its
mode, ``MODES`` and ``CompileConfig`` taking whatever ``MODE_OBJECTS`` holds, and the settings, the
torch.compile arguments and the availability each mode gives, as they were worded by mode name."""
import itertools

import pytest
import torch

from sdopt.optim.compile import MODE_OBJECTS, MODES, CompileConfig, CompileMode, nchw_conv_weight_bytes, unavailable
from sdopt.optim.compile import modes

FAMILY_BLOCKS = ("BasicTransformerBlock", "ResBlock")


def test_modes_are_the_mode_objects_names_in_order():
    assert MODES == ("compile", "compile_regional", "trace") == tuple(MODE_OBJECTS)
    assert list(MODE_OBJECTS.values()) == [modes.WHOLE, modes.REGIONAL, modes.TRACE]
    assert all(isinstance(mode, CompileMode) and mode.name == name for name, mode in MODE_OBJECTS.items())


BREAKS = "breaks torch.compile's graph"
FREEZES = "would freeze values it computes at call time (chunk sizes from free memory) into the trace"


@pytest.mark.parametrize("name, blocks_only, cache, attention_cost, note, blocks", [
    ("compile", False, True, BREAKS, "compiles on the first steps", ()),
    ("compile_regional", True, True, BREAKS, "compiles on the first steps", FAMILY_BLOCKS),
    ("trace", False, False, FREEZES, "traced per resolution; not frozen, since ComfyUI may patch weights in place", ()),
])
def test_each_mode_knows_what_the_nodes_ask_of_it(name, blocks_only, cache, attention_cost, note, blocks):
    mode = MODE_OBJECTS[name]
    assert (mode.compiles_blocks_only, mode.uses_compile_cache, mode.host_attention_cost) == (blocks_only, cache, attention_cost)
    assert mode.setup_note == note
    assert mode.block_classes(FAMILY_BLOCKS) == blocks


@pytest.mark.parametrize("name", MODES)
def test_a_configs_kind_is_the_object_of_its_mode(name):
    config = CompileConfig(name)
    assert config.mode == name and config.kind is MODE_OBJECTS[name]


def test_a_mode_object_added_to_the_table_is_a_mode_configs_take(monkeypatch):
    class Eager(CompileMode):
        name = "eager_only"

        def settings(self, config):
            return "eager"

    with pytest.raises(ValueError, match="mode must be one of compile, compile_regional, trace, not 'eager_only'"):
        CompileConfig("eager_only")
    added = Eager()
    monkeypatch.setitem(MODE_OBJECTS, added.name, added)
    config = CompileConfig("eager_only")
    assert config.kind is added and config.settings() == "eager"
    assert tuple(MODE_OBJECTS) == (*MODES, "eager_only"), "MODES is read off MODE_OBJECTS"


def _by_mode_name(config: CompileConfig) -> tuple:
    """(settings, torch.compile's arguments, whether inductor's conv weight copies count), as the code
    worded them by mode name before the modes were objects."""
    if config.mode == "trace":
        settings = f"trace{'-freeze' if config.freeze else ''}"
    else:
        settings = (f"{config.mode}-{config.backend}-{config.compile_mode}{'-dynamic' if config.dynamic else ''}"
                    f"{'-fullgraph' if config.fullgraph else ''}")
    kwargs = {
        "backend": config.backend,
        "mode": None if config.compile_mode == "default" or config.backend != "inductor" else config.compile_mode,
        "dynamic": True if config.dynamic else (None if config.mode == "compile_regional" else False),
        "fullgraph": config.fullgraph,
    }
    return settings, kwargs, config.mode != "trace" and config.backend == "inductor"


ALL_CONFIGS = [CompileConfig(mode, backend, compile_mode, dynamic, fullgraph, freeze)
               for mode, backend, compile_mode, dynamic, fullgraph, freeze in itertools.product(
                   MODES, ("inductor", "aot_eager"), ("default", "max-autotune"), (False, True), (False, True), (False, True))]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda config: f"{config.mode}-{config.backend}-{config.compile_mode}"
                         f"{'-dynamic' if config.dynamic else ''}{'-fullgraph' if config.fullgraph else ''}{'-freeze' if config.freeze else ''}")
def test_settings_and_torch_compile_arguments_are_as_they_were_worded_by_mode_name(config):
    settings, kwargs, converts = _by_mode_name(config)
    assert config.settings() == settings
    assert config.torch_compile_kwargs() == kwargs
    module = torch.nn.Conv2d(2, 4, 3)
    assert nchw_conv_weight_bytes(module, config) == (4 * 2 * 9 * 4 if converts else 0)


@pytest.mark.parametrize("name, needs_backend", [("compile", True), ("compile_regional", True), ("trace", False)])
def test_a_mode_that_compiles_asks_its_backend_and_trace_needs_none(name, needs_backend):
    reason = unavailable(CompileConfig(name, backend="cudagraphs"), torch.device("cpu"))
    if needs_backend:
        assert "CUDA device" in reason.reason and reason.input == "backend"
        assert reason.fix == "pick backend inductor, aot_eager or eager, or mode trace"
    else:
        assert reason is None
