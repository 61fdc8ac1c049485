"""nodes.attention (SDOptAttention and the override it hands ComfyUI) against fakes of ComfyUI's APIs
(0.3.x, 0.33 and 0.38 shapes).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import types

import pytest
import torch

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun
from sdopt.nodes import attention as attention_node
from sdopt.nodes import environment, patching
from sdopt.optim.attention import AUTO_NOTE, AttentionConfig, backend_function, build_attention, naive_attention

from .comfy_fakes import WrappedPatcher, install, keyed_wrappers

pytestmark = pytest.mark.usefixtures("no_comfyui")


# --- the attention override --------------------------------------------------------------------------


def _packed_qkv(dtype=torch.float32, batch=2, tokens=24, context=9, heads=4, head_dim=8):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(batch, tokens, heads * head_dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, context, heads * head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _sdpa_packed(q, k, v, heads):
    b = q.shape[0]
    split = [t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split)
    return out.transpose(1, 2).reshape(b, -1, q.shape[-1])


class Recorder:
    def __init__(self, result=None):
        self.calls, self.result = [], result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.mark.parametrize("extra, low_precision", [
    ({"scale": 0.1}, False), ({"enable_gqa": True}, False), ({"scale": 0.1, "enable_gqa": False}, False),
    ({"low_precision_attention": False}, True),
], ids=["scale", "gqa", "scale+gqa", "full precision from a low-precision backend"])
def test_override_hands_custom_scale_and_gqa_back_to_comfyui(comfy_attention, extra, low_precision):
    attention, report, func = Recorder(), Recorder(), Recorder(result="comfy's output")
    override = attention_node.comfy_attention_override(attention, report, low_precision)
    q, k, v = _packed_qkv()
    mask = torch.zeros(24, 9)
    kwargs = {"mask": mask, "attn_precision": torch.float32, "skip_reshape": False, "skip_output_reshape": True,
              "transformer_options": {"a": 1}, "_inside_attn_wrapper": True, **extra}
    assert override(func, q, k, v, 4, **kwargs) == "comfy's output"
    ((args, got),) = func.calls
    assert args[:3] == (q, k, v) and args[3] == 4 and len(args) == 4
    assert got == kwargs, "ComfyUI's function receives the same keyword arguments"
    assert report.calls == [((), {"delegated": True})]
    assert attention.calls == []


def test_override_hands_calls_no_sdopt_backend_takes_to_comfyui_when_falling_back(comfy_attention):
    """fp64 inputs: no sdopt backend runs them. ``fallback`` never fails the prompt: ComfyUI's own
    function runs that call, and the report hears of it."""
    report, func = Recorder(), Recorder(result="comfy's output")
    override = attention_node.comfy_attention_override(build_attention(AttentionConfig(backend="sdpa")), report)
    q, k, v = _packed_qkv(torch.float64)
    assert override(func, q, k, v, 4) == "comfy's output"
    ((args, _),) = func.calls
    assert args[:4] == (q, k, v, 4)
    assert report.calls == [((), {"delegated": True})]
    with pytest.raises(UserError, match="sdpa cannot run here"):
        error = attention_node.comfy_attention_override(build_attention(AttentionConfig(backend="sdpa", on_unavailable="error")), Recorder())
        error(Recorder(), q, k, v, 4)


@pytest.mark.parametrize("extra", [{}, {"scale": None}, {"enable_gqa": False}, {"transformer_options": {}},
                                   {"low_precision_attention": False}, {"low_precision_attention": True}])
def test_override_runs_the_sdopt_attention(comfy_attention, extra):
    report, func = Recorder(), Recorder()
    seen = []

    def attention(q, k, v, mask=None):
        seen.append(q.shape)
        return naive_attention(q, k, v, mask)

    override = attention_node.comfy_attention_override(attention, report)
    q, k, v = _packed_qkv()
    out = override(func, q, k, v, 4, **extra)
    assert func.calls == [] and report.calls == [((), {})]
    assert seen == [(2, 4, 24, 8)]
    torch.testing.assert_close(out, _sdpa_packed(q, k, v, 4), atol=1e-5, rtol=0)


def test_override_positional_arguments_and_reshape_flags(comfy_attention):
    override = attention_node.comfy_attention_override(backend_function("sdpa"), Recorder())
    q, k, v = _packed_qkv()
    split = [t.view(2, -1, 4, 8).transpose(1, 2) for t in (q, k, v)]
    expected = _sdpa_packed(q, k, v, 4)
    out = override(Recorder(), *split, 4, None, None, True, True)
    torch.testing.assert_close(out, expected.view(2, -1, 4, 8).transpose(1, 2), atol=1e-5, rtol=0)
    out = override(Recorder(), *split, 4, skip_reshape=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_override_upcasts_where_comfyui_asks_for_fp32(comfy_attention, monkeypatch):
    seen = []

    def attention(q, k, v, mask=None):
        seen.append(q.dtype)
        return naive_attention(q, k, v, mask)

    override = attention_node.comfy_attention_override(attention, Recorder())
    q, k, v = _packed_qkv(torch.bfloat16)
    assert override(Recorder(), q, k, v, 4, attn_precision=torch.float32).dtype == torch.bfloat16
    assert override(Recorder(), q, k, v, 4).dtype == torch.bfloat16
    assert seen == [torch.float32, torch.bfloat16]
    comfy_attention.get_attn_precision = lambda precision, dtype: None  # --dont-upcast-attention
    override(Recorder(), q, k, v, 4, attn_precision=torch.float32)
    assert seen[-1] == torch.bfloat16
    monkeypatch.setattr(environment, "comfy_attention", lambda: types.SimpleNamespace())  # no get_attn_precision
    override(Recorder(), q, k, v, 4, attn_precision=torch.float32)
    assert seen[-1] == torch.float32


def _attention_model():
    model = WrappedPatcher()
    model.load_device = "cpu"
    model.model_options["transformer_options"]["kept"] = 1
    return model


def test_attention_node_records_what_ran_in_each_run(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()  # ComfyUI 0.3.60+: per-model attention override
    model = _attention_model()
    (m,) = attention_node.SDOptAttention().patch(model, "sliced", "fallback", 0, 32)
    assert attention_node.OVERRIDE_KEY not in model.model_options["transformer_options"], "the input model is unchanged"
    options = m.model_options["transformer_options"]
    assert options["kept"] == 1
    records = patching.model_records(m.model_options)
    assert records == [{"node": "SDOptAttention", "requested": "sliced", "active": "sliced", "note": "", "short": ""}]
    override = options[attention_node.OVERRIDE_KEY]
    q, k, v = _packed_qkv()
    run = SamplingRun("r", "cpu", records)
    with run.memory_scope():
        torch.testing.assert_close(override(Recorder(), q, k, v, 4), _sdpa_packed(q, k, v, 4), atol=1e-5, rtol=0)
        assert run.optimizations[0]["active"] == "sliced"
        override(Recorder(), q, k, v, 4, scale=0.5)
    assert run.optimizations == [{"node": "SDOptAttention", "requested": "sliced", "active": "sliced", "note": attention_node.DELEGATED,
                                  "short": "some calls ran ComfyUI's own attention (custom scale, grouped-query or full precision asked)"}]
    assert records[0]["note"] == "", "the model's own record is not changed by a run"


def test_attention_node_auto_is_pending_until_sampling(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "auto", "fallback", 0, 32)
    (record,) = patching.model_records(m.model_options)
    assert record["active"] == "auto (pending)" and record["note"] == AUTO_NOTE
    run = SamplingRun("r", "cpu", [record])
    with run.memory_scope():
        m.model_options["transformer_options"][attention_node.OVERRIDE_KEY](Recorder(), *_packed_qkv(), 4)
    (ran,) = run.optimizations
    assert ran["active"] != "auto (pending)" and "rejected: " in ran["note"] and "sdpa_efficient (sdpa_efficient needs CUDA)" in ran["note"]


def test_attention_node_files_its_pick_in_runs_whose_attention_never_reaches_python(comfy_attention, patcher_extension):
    """Under a traced or compiled forward only the first run's attention calls run in Python: every
    later run's record still names what ran, filed as sampling ends."""
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "auto", "fallback", 0, 32)
    (record,) = patching.model_records(m.model_options)
    (after_sampling,) = keyed_wrappers(m, attention_node.NODE)["sampler_sample"]
    override = m.model_options["transformer_options"][attention_node.OVERRIDE_KEY]
    picks = []
    for calls in (1, 0, 0):  # eager, then traced twice
        run = SamplingRun("r", "cpu", [record])
        with run.memory_scope():
            after_sampling(lambda: [override(Recorder(), *_packed_qkv(), 4) for _ in range(calls)])
        (ran,) = run.optimizations
        picks.append(ran["active"])
    assert picks[0] != "auto (pending)" and picks == [picks[0]] * 3


def test_attention_node_falls_back_with_a_note(comfy_attention, patcher_extension):
    comfy_attention.wrap_attn = object()
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "sdpa_efficient", "fallback", 0, 32)
    (record,) = patching.model_records(m.model_options)
    assert record["active"] == "sdpa" and record["note"] == "fallback from sdpa_efficient to sdpa: sdpa_efficient needs CUDA"
    assert record["short"] == "ran sdpa instead of sdpa_efficient", "one line for the report table"
    with pytest.raises(UserError, match="needs CUDA"):
        attention_node.SDOptAttention().patch(_attention_model(), "sdpa_efficient", "error", 0, 32)


def test_attention_node_on_comfyui_without_the_override(comfy_attention, patcher_extension):
    model = _attention_model()
    (m,) = attention_node.SDOptAttention().patch(model, "sdpa", "fallback", 0, 32)
    assert attention_node.OVERRIDE_KEY not in m.model_options["transformer_options"]
    assert patching.model_records(m.model_options)[0]["active"] == "ComfyUI default"
    with pytest.raises(UserError, match="^backend: this ComfyUI has no per-model attention override"):
        attention_node.SDOptAttention().patch(model, "sdpa", "error", 0, 32)


class BaseModel038:
    """ComfyUI's BaseModel where ``estimate_memory`` passes the attention's memory profile."""

    def memory_required(self, input_shape, cond_shapes={}, memory_efficient_attention=None):
        return 0


class BaseModel033:
    def memory_required(self, input_shape, cond_shapes={}):
        return 0


@pytest.mark.parametrize(("backend", "profile"), [
    ("sliced", True), ("sub_quadratic", True), ("low_memory", True), ("naive", False), ("sdpa_math", False),
    ("auto", None), ("sdpa", None), ("sdpa_efficient", None),  # sdpa_efficient needs CUDA: it falls back to sdpa here
])
def test_attention_node_tells_comfyuis_memory_estimate_how_its_attention_grows(
        comfy_attention, patcher_extension, monkeypatch, backend, profile):
    comfy_attention.wrap_attn = object()
    install(monkeypatch, "comfy.model_base", BaseModel=BaseModel038)
    model = _attention_model()
    model.model_options[patching.ATTENTION_MEMORY_KEY] = False  # an earlier node's override (ComfyUI's default profile)
    (m,) = attention_node.SDOptAttention().patch(model, backend, "fallback", 0, 32)
    assert m.model_options.get(patching.ATTENTION_MEMORY_KEY) is profile, "None: left to ComfyUI's own backend's profile"
    assert model.model_options[patching.ATTENTION_MEMORY_KEY] is False, "the input model is unchanged"


def test_an_older_comfyui_gets_no_memory_profile(comfy_attention, patcher_extension, monkeypatch):
    comfy_attention.wrap_attn = object()
    install(monkeypatch, "comfy.model_base", BaseModel=BaseModel033)
    (m,) = attention_node.SDOptAttention().patch(_attention_model(), "sliced", "fallback", 0, 32)
    assert patching.ATTENTION_MEMORY_KEY not in m.model_options
