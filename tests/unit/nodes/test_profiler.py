"""nodes.profiler (SDOptProfiler and its sampling wrappers) against fakes of ComfyUI's APIs (0.3.x, 0.33
and 0.38 shapes).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import sys
import types

import pytest

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun, active_run
from sdopt.nodes import patching, prompt_context
from sdopt.nodes import profiler as profiler_node

from .comfy_fakes import PROMPT, SD15, SSD1B, AuraFlow, WrappedPatcher, base_model, install, keyed_wrappers

pytestmark = pytest.mark.usefixtures("no_comfyui")


# --- the profiler wrappers ----------------------------------------------------------------------------


class SamplerExecutor:
    """ComfyUI's SAMPLER_SAMPLE executor: records what it got and calls the callback once per step."""

    def __init__(self, steps=3):
        self.steps, self.calls = steps, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        callback = args[3] if len(args) > 3 else kwargs.get("callback")
        for i in range(self.steps):
            if callback is not None:
                callback(i, None, None, self.steps)
        return "samples"


def test_sampler_sample_wraps_a_positional_callback_and_passes_the_rest(monkeypatch):
    heard, executor = [], SamplerExecutor()
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        out = profiler_node._sampler_sample(executor, "guider", "sigmas", {"x": 1}, lambda *a: heard.append(a), "noise", "latent",
                                            denoise_mask=None, disable_pbar=True, new_argument="passed")
    assert out == "samples"
    ((args, kwargs),) = executor.calls
    assert args[:3] == ("guider", "sigmas", {"x": 1}) and args[4:] == ("noise", "latent")
    assert kwargs == {"denoise_mask": None, "disable_pbar": True, "new_argument": "passed"}
    assert heard == [(i, None, None, 3) for i in range(3)], "the original callback still hears every step"
    assert len(run.result().steps) == 3


def test_sampler_sample_wraps_a_keyword_callback(monkeypatch):
    heard, executor = [], SamplerExecutor(2)
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        profiler_node._sampler_sample(executor, "guider", "sigmas", callback=lambda *a: heard.append(a), latent_shapes=[(1, 4, 8, 8)])
    ((args, kwargs),) = executor.calls
    assert args == ("guider", "sigmas") and kwargs["latent_shapes"] == [(1, 4, 8, 8)]
    assert len(heard) == 2 and len(run.result().steps) == 2


def test_sampler_sample_steps_without_a_callback():
    executor = SamplerExecutor(2)
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        profiler_node._sampler_sample(executor, "guider", "sigmas", {}, None, "noise")
    (args, _), = executor.calls
    assert callable(args[3]) and len(run.result().steps) == 2


def test_sampler_sample_outside_a_run_passes_everything_unchanged():
    executor, callback = SamplerExecutor(1), print
    assert active_run() is None
    profiler_node._sampler_sample(executor, "g", "s", {}, callback, extra=1)
    assert executor.calls == [(("g", "s", {}, callback), {"extra": 1})]


class OuterExecutor:
    """ComfyUI's OUTER_SAMPLE executor: ``class_obj`` is the guider; sampling runs the inner wrapper."""

    def __init__(self, records, config_class=None):
        patcher = types.SimpleNamespace(load_device="cpu", model=base_model(config_class or SD15))
        self.class_obj = types.SimpleNamespace(model_patcher=patcher, model_options={patching.RECORDS_KEY: records})
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        assert active_run() is not None, "sampling runs inside the run's memory scope"
        return profiler_node._sampler_sample(SamplerExecutor(4), self.class_obj, "sigmas", {}, None, "noise")


def test_outer_sample_files_a_run_and_passes_new_arguments(prompts, monkeypatch):
    timers = []
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda prompt_id, node_id=None: timers.append((prompt_id, node_id)))
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    records = [{"node": "SDOptAttention", "requested": "auto", "active": "auto (pending)", "note": ""}]
    executor = OuterExecutor(records)
    outer = profiler_node._outer_sample("fp16 run")
    out = outer(executor, "noise", "latent", "sampler", "sigmas", None, None, False, 42, latent_shapes=[(1, 4, 8, 8)])
    assert out == "samples"
    assert executor.calls == [(("noise", "latent", "sampler", "sigmas", None, None, False, 42), {"latent_shapes": [(1, 4, 8, 8)]})]
    assert timers == [(PROMPT, "5")]
    (run,) = prompt_context.prompt_log(PROMPT).runs
    assert run["label"] == "fp16 run" and len(run["steps"]) == 4 and run["memory_kind"] == "ram_rss"
    assert run["model_family"] == "SD1.5"
    assert run["optimizations"] == records and run["optimizations"][0] is not records[0]
    assert active_run() is None
    outer(executor, "noise", "latent", "sampler", "sigmas")
    assert len(prompt_context.prompt_log(PROMPT).runs) == 2, "every sampling run is filed"


@pytest.mark.parametrize("config_class,family", [(SSD1B, "SDXL"), (AuraFlow, "family unknown (AuraFlow)")])
def test_each_run_names_the_model_family(prompts, monkeypatch, config_class, family):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    profiler_node._outer_sample("run")(OuterExecutor([], config_class), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["model_family"] == family


def test_outer_sample_counts_dynamic_vram_where_comfyui_0_38_maps_it(prompts, monkeypatch):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    monkeypatch.setattr(prompt_context, "current_node_id", lambda: "5")
    outer = profiler_node._outer_sample("dynamic")
    install(monkeypatch, "comfy.memory_management", aimdo_enabled=False)
    install(monkeypatch, "comfy_aimdo.control", get_total_vram_usage=lambda: 3 * 2**30)
    outer(OuterExecutor([]), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["peak_outside_allocator_bytes"] is None, "aimdo off: nothing to count"
    sys.modules["comfy.memory_management"].aimdo_enabled = True
    outer(OuterExecutor([]), "noise")
    assert prompt_context.prompt_log(PROMPT).runs[-1]["peak_outside_allocator_bytes"] == 3 * 2**30


def test_profiler_node_clones_with_its_wrappers(patcher_extension, prompts, monkeypatch):
    monkeypatch.setattr(prompt_context, "install_node_timer", lambda *a: False)
    model = WrappedPatcher()
    (out,) = profiler_node.SDOptProfiler().apply(model, "  base  ")
    keyed = keyed_wrappers(out, profiler_node.NODE)
    assert set(keyed) == {"outer_sample", "sampler_sample"} and keyed["sampler_sample"] == [profiler_node._sampler_sample]
    assert keyed_wrappers(model, profiler_node.NODE) == {}
    with pytest.raises(UserError, match="^label: "):
        profiler_node.SDOptProfiler().apply(model, "   ")
