"""nodes.patching against fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes): keyed wrappers, the heap
trim after sampling, the records on models and in runs, VAE copies with wrapped methods, on_unavailable.

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import types

import pytest

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun
from sdopt.nodes import patching, prompt_context

from .comfy_fakes import PROMPT, FakeVAE, WrappedPatcher, keyed_wrappers

pytestmark = pytest.mark.usefixtures("no_comfyui")


# --- keyed wrappers -----------------------------------------------------------------------------------

def test_patched_clone_replaces_its_own_key_and_keeps_others(patcher_extension):
    def f1(executor, *a, **k): ...
    def f2(executor, *a, **k): ...
    def g1(executor, *a, **k): ...
    def other(executor, *a, **k): ...

    model = WrappedPatcher()
    model.add_wrapper_with_key("outer_sample", "someone_else", other)
    model.add_wrapper_with_key("apply_model", "someone_else", other)
    first = patching.patched_clone(model, "SDOptProfiler", {"OUTER_SAMPLE": f1, "SAMPLER_SAMPLE": f2})
    assert keyed_wrappers(first, "SDOptProfiler") == {"outer_sample": [f1], "sampler_sample": [f2]}
    second = patching.patched_clone(first, "SDOptProfiler", {"OUTER_SAMPLE": g1})
    assert keyed_wrappers(second, "SDOptProfiler") == {"outer_sample": [g1]}, "the second call's wrappers only"
    assert keyed_wrappers(second, "someone_else") == {"outer_sample": [other], "apply_model": [other]}
    assert keyed_wrappers(first, "SDOptProfiler") == {"outer_sample": [f1], "sampler_sample": [f2]}, "the input clone is unchanged"
    assert keyed_wrappers(model, "SDOptProfiler") == {}
    third = patching.patched_clone(second, "SDOptProfiler")
    assert keyed_wrappers(third, "SDOptProfiler") == {} and keyed_wrappers(third, "someone_else") == keyed_wrappers(model, "someone_else")


def test_make_outermost_moves_only_the_order_of_one_kind(patcher_extension):
    model = WrappedPatcher()
    model.add_wrapper_with_key("apply_model", "someone_else", print)
    model.add_wrapper_with_key("outer_sample", "someone_else", print)
    patching.set_wrappers(model, "K", {"APPLY_MODEL": repr, "OUTER_SAMPLE": repr})
    patching.make_outermost(model, "K", "APPLY_MODEL")
    assert list(model.wrappers["apply_model"]) == ["K", "someone_else"], "ComfyUI runs the first key outermost"
    assert list(model.wrappers["outer_sample"])[:2] == ["someone_else", "K"]
    assert model.wrappers["apply_model"]["K"] == [repr] and model.wrappers["apply_model"]["someone_else"] == [print]
    patching.make_outermost(model, "absent", "APPLY_MODEL")
    assert list(model.wrappers["apply_model"]) == ["K", "someone_else"]


def test_set_wrappers_in_place_twice(patcher_extension):
    model = WrappedPatcher()
    patching.set_wrappers(model, "K", {"APPLY_MODEL": print})
    patching.set_wrappers(model, "K", {"APPLY_MODEL": repr, "DIFFUSION_MODEL": repr})
    assert keyed_wrappers(model, "K") == {"apply_model": [repr], "diffusion_model": [repr]}
    with pytest.raises(AttributeError):
        patching.set_wrappers(model, "K", {"NO_SUCH_TYPE": repr})


def test_every_patched_model_trims_the_heap_once_after_each_sampling_run(patcher_extension, monkeypatch):
    trims = []
    monkeypatch.setattr(patching, "trim_heap", lambda: trims.append("trim"))
    first = patching.patched_clone(WrappedPatcher(), "A", {"APPLY_MODEL": repr})
    second = patching.patched_clone(first, "B")
    (outer,) = keyed_wrappers(second, patching.HEAP_TRIM_KEY)["outer_sample"]
    assert keyed_wrappers(second, patching.HEAP_TRIM_KEY) == {"outer_sample": [outer]}, "chained nodes install it once"

    def sampling(*args):
        trims.append("sampled")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        outer(sampling, "noise")
    assert trims == ["sampled", "trim"], "after the run, failed or not"


def test_the_outermost_vae_wrapper_trims_the_heap_once_per_call(prompts, monkeypatch):
    trims, log = [], []
    monkeypatch.setattr(patching, "trim_heap", lambda: trims.append(len(log)))
    second = patching.wrap_vae_methods(patching.wrap_vae_methods(FakeVAE(), _tracing(log, "first")), _tracing(log, "second"))
    second.decode(1), second.encode(2)
    assert trims == [2, 4], "once after each call, when both wrappers are done"


# --- records on models and in runs --------------------------------------------------------------------


def test_records_on_models_replace_per_node():
    model = WrappedPatcher()
    patching.record_model(model, "A", "x", "y")
    patching.record_model(model, "A", "x", "z", "again")
    patching.record_model(model, "B", "1", "2")
    assert patching.model_records(model.model_options) == [
        {"node": "A", "requested": "x", "active": "z", "note": "again", "short": ""},
        {"node": "B", "requested": "1", "active": "2", "note": "", "short": ""},
    ]
    assert model.model_options[patching.RECORDS_KEY] is patching.model_records(model.model_options)
    clone = model.clone()
    patching.record_model(clone, "A", "x", "clone")
    assert patching.model_records(model.model_options)[0]["active"] == "z", "a clone's records are its own"


def test_record_in_run_reaches_only_an_active_run():
    patching.record_in_run("A", "auto", "sdpa")  # no run: nothing happens
    seed = [{"node": "A", "requested": "auto", "active": "auto (pending)", "note": ""}]
    run = SamplingRun("r", "cpu", seed)
    with run.memory_scope():
        patching.record_in_run("A", "auto", "sdpa", "timed")
    assert run.optimizations == [{"node": "A", "requested": "auto", "active": "sdpa", "note": "timed", "short": ""}]
    assert seed[0]["active"] == "auto (pending)"


# --- VAE copies -------------------------------------------------------------------------------------


def _tracing(log, tag):
    def wrap(name, inner):
        def call(self, *args, **kwargs):
            log.append((tag, name, self))
            return inner(self, *args, **kwargs)

        return call

    return wrap


def test_wrapped_vae_files_its_records_on_every_call(prompts):
    vae, log = FakeVAE(), []
    out = patching.wrap_vae_methods(vae, _tracing(log, "one"))
    patching.record_vae(out, "SDOptVAEPrecision", "fp16", "fp16")
    assert not hasattr(vae, "sdopt_records"), "the input VAE gets no records"
    assert out.decode(3) == 6 and out.encode(4) == 2
    assert log == [("one", "decode", out), ("one", "encode", out)]
    assert vae.calls == [("decode", 3), ("encode", 4)], "the shared state is the input's (a shallow copy)"
    assert prompt_context.prompt_log(PROMPT).records == [{"node": "SDOptVAEPrecision", "requested": "fp16", "active": "fp16", "note": "", "short": ""}]
    out.decode(1)
    assert len(prompt_context.prompt_log(PROMPT).records) == 1, "one record per node, however many calls"
    prompt_context._prompts.clear()
    out.decode(1)  # a later prompt served this VAE node from cache: the record comes again
    assert prompt_context.prompt_log(PROMPT).records[0]["node"] == "SDOptVAEPrecision"
    assert not hasattr(out, "decode_tiled"), "methods the VAE lacks are not invented"


def test_input_vae_methods_are_unchanged(prompts):
    vae = FakeVAE()
    patching.wrap_vae_methods(vae, _tracing([], "one"))
    assert "decode" not in vars(vae) and vae.decode.__func__ is FakeVAE.decode
    assert vae.decode(2) == 4 and prompt_context.prompt_log(PROMPT).records == []


def test_chained_copies_run_every_wrapper_on_their_own_self(prompts):
    vae, log = FakeVAE(), []
    first = patching.wrap_vae_methods(vae, _tracing(log, "first"))
    patching.record_vae(first, "SDOptVAEPrecision", "fp16", "fp16")
    second = patching.wrap_vae_methods(first, _tracing(log, "second"))
    patching.record_vae(second, "SDOptVAEAttention", "sdpa", "sdpa")
    assert second.decode(5) == 10
    assert log == [("second", "decode", second), ("first", "decode", second)]
    assert [r["node"] for r in prompt_context.prompt_log(PROMPT).records] == ["SDOptVAEPrecision", "SDOptVAEAttention"]
    assert [r["node"] for r in first.sdopt_records] == ["SDOptVAEPrecision"], "a later node's record stays on its copy"
    log.clear()
    first.decode(1)
    assert log == [("first", "decode", first)], "the earlier copy still runs only its own wrapper"


def test_copy_vae_rebinds_methods_and_copies_records():
    vae = FakeVAE()
    vae.sdopt_records = [{"node": "A", "requested": "x", "active": "y", "note": ""}]
    vae.helper = types.MethodType(lambda self: self, vae)
    vae.foreign = types.MethodType(lambda self: self, object())
    duplicate = patching.copy_vae(vae)
    assert duplicate.helper() is duplicate and vae.helper() is vae
    assert duplicate.foreign is vae.foreign, "methods bound to something else are left alone"
    patching.record_vae(duplicate, "A", "x", "z")
    assert vae.sdopt_records[0]["active"] == "y"


# --- on_unavailable -----------------------------------------------------------------------------------


def test_fall_back_or_raise_is_every_nodes_on_unavailable():
    from sdopt.errors import Unavailable

    problem = Unavailable("no GPU here", "run it on a GPU", "mode")
    assert patching.fall_back_or_raise("fallback", None, "run eager") is None
    assert patching.fall_back_or_raise("error", None, "run eager") is None
    assert patching.fall_back_or_raise("fallback", problem, "run eager") == "no GPU here (fix: run it on a GPU)"
    with pytest.raises(UserError) as raised:
        patching.fall_back_or_raise("error", problem, "run eager")
    assert str(raised.value) == "mode: no GPU here; run it on a GPU (or set on_unavailable to fallback to run eager)"
