"""nodes.fast_path (the chain SDOptCompile, SDOptCUDAGraph and SDOptStepCache configure) against fakes
of ComfyUI's patcher and UNet calling convention."""
import types

import pytest
import torch

from sdopt.errors import UserError
from sdopt.measure.profiler import SamplingRun, active_run
from sdopt.nodes import environment, patching
from sdopt.nodes.compile import CHAIN_MEMBER as COMPILE
from sdopt.nodes.cuda_graph import CHAIN_MEMBER as GRAPH
from sdopt.nodes.fast_path import FAST_PATH_KEY, ChainMember, FastPath, fast_path_of
from sdopt.nodes.step_cache import CHAIN_MEMBER as STEP_CACHE
from sdopt.optim.precision import converted_copy

from .comfy_fakes import (SD3, SDXL, SSD1B, AuraFlow, FastPatcher, TinyMMDiT, TinyUNet, TinyXLUNet, install, keyed_wrappers,
                          sdxl_vector, unet_inputs)

pytestmark = pytest.mark.usefixtures("no_comfyui")


class Executor:
    """ComfyUI's WrapperExecutor as a wrapper receives it: call it to run the rest, ``class_obj`` is the UNet."""

    def __init__(self, unet, wrappers=1, idx=0):
        self.class_obj, self.wrappers, self.idx, self.calls = unet, [None] * wrappers, idx, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.class_obj._forward(*args, **kwargs)


class DynamicPatcher(FastPatcher):
    """0.38's ModelPatcherDynamic as the compile and graph nodes see it."""

    def is_dynamic(self):
        return True

    def get_non_dynamic_delegate(self):
        delegate = FastPatcher.clone(self)
        delegate.__class__ = FastPatcher
        delegate.model_options["delegate"] = True
        return delegate


def _compile_node(model, mode="trace"):
    from sdopt.nodes.compile import SDOptCompile

    return SDOptCompile().patch(model, mode, "inductor", "default", False, False, "fallback")[0]


def test_compile_node_runs_on_the_non_dynamic_delegate_of_a_dynamic_patcher(patcher_extension):
    patched = _compile_node(DynamicPatcher())
    assert patched.model_options.get("delegate") and not hasattr(patched, "is_dynamic")
    (record,) = patching.model_records(patched.model_options)
    assert "non-dynamic delegate" in record["note"]
    plain = _compile_node(FastPatcher())
    assert "delegate" not in plain.model_options and "non-dynamic" not in patching.model_records(plain.model_options)[0]["note"]


class UnreloadablePatcher(DynamicPatcher):
    """A dynamic VRAM model from a loader that left ComfyUI no way to load it again."""

    def get_non_dynamic_delegate(self):
        raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")


def test_compile_node_without_a_non_dynamic_delegate_follows_on_unavailable(patcher_extension):
    from sdopt.nodes.compile import SDOptCompile

    patched = _compile_node(UnreloadablePatcher())
    assert fast_path_of(patched) is None and patched.is_dynamic(), "eager, streamed by ComfyUI as before"
    (record,) = patching.model_records(patched.model_options)
    assert record["active"] == "eager" and "cached_patcher_init is not initialized" in record["note"]
    assert keyed_wrappers(patched, patching.HEAP_TRIM_KEY), "an eager clone still hands freed host memory back after sampling"
    with pytest.raises(UserError, match=r"^model: ComfyUI's dynamic VRAM streams this model"):
        SDOptCompile().patch(UnreloadablePatcher(), "trace", "inductor", "default", False, False, "error")


@torch.inference_mode()
def test_fast_path_calls_the_unet_with_tensors_and_stable_options_only(patcher_extension):
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    unet = TinyUNet()
    override = object()
    for seed, steps in ((0, 20), (1, 40), (2, 30)):
        options = {"optimized_attention_override": override, "sigmas": torch.rand(1), "sample_sigmas": torch.rand(steps + 1), "cond_or_uncond": [1, 0]}
        x, t, context = unet_inputs(seed)
        executor = Executor(unet)
        out = fast_path(executor, x, t, context, None, None, options)
        torch.testing.assert_close(out, unet._forward(x, t, context), rtol=0, atol=0)
        assert executor.calls == 0, "the compiled path, not the executor, ran"
    fast_path_calls = [keys for keys in unet.seen_options if keys]
    assert fast_path_calls and all(keys == ["optimized_attention_override"] for keys in fast_path_calls), "per-step options never reach the UNet"
    (stats,), graphs = fast_path.stats("SDOptCompile"), fast_path.stats("SDOptCUDAGraph")
    assert stats.compilations == 1 and graphs == []


@torch.inference_mode()
def test_a_call_the_chain_cannot_serve_runs_without_the_options_set_for_the_chain_only(patcher_extension):
    from sdopt.nodes.fast_path import CHAIN_ONLY_ATTRIBUTE

    fast_path = fast_path_of(_compile_node(FastPatcher()))
    unet = TinyUNet()

    def route(func, *args, **kwargs):
        return func(*args, **kwargs)

    setattr(route, CHAIN_ONLY_ATTRIBUTE, True)
    other = object()
    x, t, context = unet_inputs(0)
    control = {"output": []}
    options = {"optimized_attention_override": route, "sigmas": torch.rand(1), "other": other}
    fast_path(Executor(unet), x, t, context, None, control, options)
    fast_path(Executor(unet), x, t, context, control=control, transformer_options=options)
    assert unet.seen_options == [["other", "sigmas"]] * 2, "positional or keyword, ControlNet's eager call keeps ComfyUI's attention"
    assert "optimized_attention_override" in options, "the caller's options are left as they were"
    assert fast_path.eager_reasons == {"ControlNet (control) inputs": 2}


class ApplyModel:
    """ComfyUI's APPLY_MODEL executor: ``class_obj`` is the BaseModel, calling it runs ``_apply_model``,
    which calls the diffusion model (here: with SD3's keyword inputs)."""

    def __init__(self, diffusion_model, fail=False):
        self.class_obj, self.fail = types.SimpleNamespace(diffusion_model=diffusion_model), fail

    def __call__(self, x, t, context, y, transformer_options):
        out = self.class_obj.diffusion_model(x, t, context=context, y=y, control=None, transformer_options=transformer_options)
        if self.fail:
            raise RuntimeError("interrupted")
        return out


@torch.inference_mode()
def test_sd3s_mmdit_is_routed_through_the_fast_path_for_each_call_and_restored(patcher_extension):
    """ComfyUI runs no DIFFUSION_MODEL wrappers around SD3's model: the fast path sits in an APPLY_MODEL
    wrapper that routes the model's forward through it while the call lasts."""
    patched = _compile_node(FastPatcher(SD3))
    assert set(keyed_wrappers(patched, FAST_PATH_KEY)) == {"apply_model", "sampler_sample"}
    (router,) = keyed_wrappers(patched, FAST_PATH_KEY)["apply_model"]
    fast_path = fast_path_of(patched)
    assert router.fast_path is fast_path and fast_path.family.call.plain_forward == "forward"
    mmdit = TinyMMDiT()
    x, t, context = unet_inputs()
    y = sdxl_vector(0)
    reference = mmdit(x, t, context, y)
    for _ in range(3):
        torch.testing.assert_close(router(ApplyModel(mmdit), x, t, context, y, {}), reference, rtol=0, atol=0)
        assert "forward" not in mmdit.__dict__, "the model's own forward is back after the call"
    (stats,) = fast_path.stats("SDOptCompile")
    assert stats.compilations == 1 and not fast_path.eager_reasons
    with pytest.raises(RuntimeError, match="interrupted"):
        router(ApplyModel(mmdit, fail=True), x, t, context, y, {})
    assert "forward" not in mmdit.__dict__, "restored after a failed call too"
    torch.testing.assert_close(mmdit(x, t, context, y), reference, rtol=0, atol=0)


@pytest.mark.parametrize("case,reason", [
    (dict(control={"output": []}), "ControlNet"),
    (dict(transformer_options={"patches": {"attn1_patch": [print]}}), "transformer patches"),
    (dict(num_video_frames=torch.ones(1)), "extra model inputs"),
    (dict(executor=dict(wrappers=2, idx=0)), "another DIFFUSION_MODEL wrapper"),
])
@torch.inference_mode()
def test_fast_path_runs_eager_where_it_cannot_serve_and_counts_why(patcher_extension, case, reason):
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    unet = TinyUNet()
    executor = Executor(unet, **case.pop("executor", {}))
    x, t, context = unet_inputs()
    kwargs = {"control": None, "transformer_options": {}, **case}
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("control", "transformer_options")}
    executor.class_obj._forward = lambda *a, **k: "eager"
    assert fast_path(executor, x, t, context, None, kwargs["control"], kwargs["transformer_options"], **extra) == "eager"
    assert executor.calls == 1 and list(fast_path.eager_reasons) and reason in next(iter(fast_path.eager_reasons))


def test_compile_and_graph_share_one_fast_path_in_either_order(patcher_extension, monkeypatch):
    from sdopt.nodes import cuda_graph as graph_node

    monkeypatch.setattr(graph_node, "unavailable", lambda config, device: None)
    graph = lambda model: graph_node.SDOptCUDAGraph().patch(model, 3, "fallback")[0]  # noqa: E731
    for model in (graph(_compile_node(FastPatcher())), _compile_node(graph(FastPatcher()))):
        fast_path = fast_path_of(model)
        assert fast_path.config_of("SDOptCompile").mode == "trace" and fast_path.config_of("SDOptCUDAGraph").max_graphs == 3
        assert set(fast_path.requested) == {"SDOptCompile", "SDOptCUDAGraph"}
        assert keyed_wrappers(model, FAST_PATH_KEY) == {"diffusion_model": [fast_path], "sampler_sample": keyed_wrappers(model, FAST_PATH_KEY)["sampler_sample"]}


def test_graph_node_on_a_cpu_passes_through_or_stops(patcher_extension):
    from sdopt.nodes.cuda_graph import SDOptCUDAGraph

    (passed,) = SDOptCUDAGraph().patch(FastPatcher(), 4, "fallback")
    assert fast_path_of(passed) is None
    assert "CUDA graphs need a CUDA device" in patching.model_records(passed.model_options)[0]["note"]
    with pytest.raises(UserError, match="^on_unavailable: CUDA graphs need a CUDA device"):
        SDOptCUDAGraph().patch(FastPatcher(), 4, "error")


@torch.inference_mode()
def test_capture_runs_with_comfyuis_malloc_graph_paused(patcher_extension, monkeypatch):
    import contextlib

    paused = []

    @contextlib.contextmanager
    def pause_malloc_graph():
        paused.append(True)
        yield

    install(monkeypatch, "comfy.model_prefetch", pause_malloc_graph=pause_malloc_graph)
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    fast_path(Executor(TinyUNet()), *unet_inputs(), None, None, {})
    assert paused == [True]


@torch.inference_mode()
def test_the_compile_record_says_when_inductor_converts_nchw_conv_weights_every_step(patcher_extension, tmp_path):
    def record_after_sampling(unet):
        model = _compile_node(FastPatcher(), "compile")
        fast_path = fast_path_of(model)
        fast_path.cache_root = tmp_path
        fast_path._runner(unet, {})
        (report,) = keyed_wrappers(model, FAST_PATH_KEY)["sampler_sample"]
        run = SamplingRun("r", "cpu")
        with run.memory_scope():
            report(lambda: None)
        (record,) = [r for r in run.optimizations if r["node"] == "SDOptCompile"]
        return record["note"]

    unet = TinyUNet()
    assert "NCHW" not in record_after_sampling(unet), "576 bytes of conv weights: a copy too small to mention"
    unet.wide = torch.nn.Conv2d(256, 256, 3)
    assert "2 MiB of conv weights are stored NCHW" in record_after_sampling(unet)
    assert "NCHW" not in record_after_sampling(converted_copy(unet, torch.float32, channels_last=True))


@torch.inference_mode()
def test_the_record_says_when_comfyui_never_called_the_fast_path(patcher_extension):
    model = _compile_node(FastPatcher(), "trace")
    fast_path, (report,) = fast_path_of(model), keyed_wrappers(model, FAST_PATH_KEY)["sampler_sample"]

    def record_of(sample):
        run = SamplingRun("r", "cpu")
        with run.memory_scope():
            report(sample)
        (record,) = run.optimizations
        return record

    skipped = record_of(lambda: None)  # a ComfyUI whose diffusion model runs no DIFFUSION_MODEL wrapper
    assert skipped["short"].startswith("did nothing: ComfyUI never called the diffusion model through the fast path")
    ran = record_of(lambda: fast_path(Executor(TinyUNet()), *unet_inputs(), None, None, {}))
    assert "never called" not in ran["note"] and "never called" not in ran["short"]


@torch.inference_mode()
def test_the_record_counts_each_runs_eager_calls_only(patcher_extension):
    """A run cancelled after its first calls, then a full one: the full run's record counts its own."""
    model = _compile_node(FastPatcher(), "trace")
    fast_path, (report,) = fast_path_of(model), keyed_wrappers(model, FAST_PATH_KEY)["sampler_sample"]
    patched = {"transformer_options": {"patches": {"attn1_patch": [print]}}}

    def sample(calls, cancel=False):
        for _ in range(calls):
            fast_path(Executor(TinyUNet()), *unet_inputs(), None, None, **patched)
        if cancel:
            raise KeyboardInterrupt("cancelled")

    run = SamplingRun("r", "cpu")
    with run.memory_scope(), pytest.raises(KeyboardInterrupt):
        report(sample, 5, cancel=True)
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        report(sample, 3)
    (record,) = run.optimizations
    assert "transformer patches" in record["note"] and "(3x)" in record["note"] and "(8x)" not in record["note"]


def _profiled_steps(fast_path, unet, steps):
    """The steps of a profiled run whose every step is one fast-path call."""
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        run.start()
        for seed in range(steps):
            fast_path(Executor(unet), *unet_inputs(seed), None, None, {})
            run.step()
        run.finish()
    return run.result()


@torch.inference_mode()
def test_the_step_whose_call_compiles_is_warm_up_and_out_of_the_steady_rate(patcher_extension):
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    result = _profiled_steps(fast_path, TinyUNet(), 4)
    (stats,) = fast_path.stats("SDOptCompile")
    assert stats.compilations == 1
    assert [s["warmup"] for s in result.steps] == [{}, {"compile": stats.compile_seconds}, {}, {}], (
        "the first call of a shape runs eagerly: the compile lands in step 1"
    )
    assert result.steady_steps == [2, 3]
    assert result.steady_it_per_s == pytest.approx(2 / sum(s["seconds"] for s in result.steps[2:]))


class RecomputingCapture:
    """A capture backend for a CPU: warm-up runs as the CUDA one does, then a 'graph' that recomputes."""

    def capture(self, fn, static_inputs, warmup_runs):
        from sdopt.optim.cuda_graph import Captured

        for _ in range(warmup_runs):
            fn(*static_inputs)
        output = fn(*static_inputs)
        return Captured(static_inputs, output, lambda: output.copy_(fn(*static_inputs)))


@torch.inference_mode()
def test_the_step_whose_call_captures_is_warm_up_with_the_compile_inside_counted_once(patcher_extension, monkeypatch):
    from sdopt.nodes import cuda_graph as graph_node
    from sdopt.optim import cuda_graph

    monkeypatch.setattr(graph_node, "unavailable", lambda config, device: None)
    monkeypatch.setattr(cuda_graph, "unavailable", lambda config, device: None)
    monkeypatch.setattr(cuda_graph, "CUDACaptureBackend", RecomputingCapture)
    model = graph_node.SDOptCUDAGraph().patch(_compile_node(FastPatcher()), 4, "fallback")[0]
    fast_path = fast_path_of(model)
    result = _profiled_steps(fast_path, TinyUNet(), 3)
    (compile_stats,), (graph_stats,) = fast_path.stats("SDOptCompile"), fast_path.stats("SDOptCUDAGraph")
    assert (compile_stats.compilations, graph_stats.captures, graph_stats.replays) == (1, 1, 3)
    first, *rest = [s["warmup"] for s in result.steps]
    assert set(first) == {"compile", "capture"} and rest == [{}, {}], "the capture's warm-up runs compile, in step 0"
    assert first["compile"] == compile_stats.compile_seconds
    assert first["compile"] + first["capture"] == pytest.approx(graph_stats.capture_seconds)
    assert result.steady_steps == [1, 2]


@torch.inference_mode()
def test_a_fast_path_call_outside_a_profiled_run_marks_nothing(patcher_extension):
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    unet = TinyUNet()
    for seed in range(2):
        fast_path(Executor(unet), *unet_inputs(seed), None, None, {})
    assert active_run() is None and fast_path.stats("SDOptCompile")[0].compilations == 1


@torch.inference_mode()
def test_fast_path_gives_sdxls_y_to_the_compiled_unet_as_an_input(patcher_extension):
    fast_path = fast_path_of(_compile_node(FastPatcher(SSD1B)))
    assert fast_path.family.label == "SDXL"
    unet = TinyXLUNet()
    for seed in range(4):
        x, t, context = unet_inputs(seed)
        executor = Executor(unet)
        y = sdxl_vector(seed)
        # ComfyUI's executor passes the inputs positionally; a caller may name them
        args, kwargs = ((x, t, context, y, None, {}), {}) if seed % 2 else ((x, t), dict(context=context, y=y, control=None, transformer_options={}))
        out = fast_path(executor, *args, **kwargs)
        torch.testing.assert_close(out, unet._forward(x, t, context, y), rtol=0, atol=0)
        assert executor.calls == 0, "the traced path, not the executor, ran"
    (stats,) = fast_path.stats("SDOptCompile")
    assert stats.compilations == 1, "one trace serves every y of one shape: y is its input, not a constant"


class GuidedUNet(TinyUNet):
    """A family whose forward takes one more tensor input (a guidance scale) before ``control``."""

    def _forward(self, x, timesteps=None, context=None, y=None, guidance=None, control=None, transformer_options={}):
        return super()._forward(x, timesteps, context) * guidance[:, None, None, None]


@torch.inference_mode()
def test_fast_path_binds_the_tensor_inputs_its_family_names(patcher_extension):
    import dataclasses

    from sdopt.families import SD15 as SD15_FAMILY
    from sdopt.families import DiffusionCall
    from sdopt.optim.compile import CompileConfig

    guided = dataclasses.replace(SD15_FAMILY, call=DiffusionCall(tensor_inputs=("x", "timesteps", "context", "y", "guidance")))
    fast_path = FastPath({COMPILE: CompileConfig("trace")}, environment.ModelFamily(guided, "Guided"))
    unet = GuidedUNet()
    for seed in range(3):
        x, t, context = unet_inputs(seed)
        guidance = torch.full((2,), 1.0 + seed)
        executor = Executor(unet)
        out = fast_path(executor, x, t, context, None, guidance, None, {})
        torch.testing.assert_close(out, unet._forward(x, t, context, None, guidance), rtol=0, atol=0)
        assert executor.calls == 0 and not fast_path.eager_reasons, "guidance is an input, not ControlNet's control"


@torch.inference_mode()
def test_fast_path_runs_eager_on_more_positional_inputs_than_its_family_calls_with(patcher_extension):
    fast_path = fast_path_of(_compile_node(FastPatcher()))
    unet = GuidedUNet()
    executor = Executor(unet)
    x, t, context = unet_inputs()
    out = fast_path(executor, x, t, context, None, torch.ones(2), None, {})
    assert executor.calls == 1
    torch.testing.assert_close(out, unet._forward(x, t, context, None, torch.ones(2)), rtol=0, atol=0)
    assert list(fast_path.eager_reasons) == ["more positional inputs than SD1.5's call takes"]


@torch.inference_mode()
def test_a_model_of_an_unknown_family_keeps_the_unet_call_and_the_records_say_so(patcher_extension):
    from sdopt.nodes.cuda_graph import SDOptCUDAGraph

    model = _compile_node(FastPatcher(AuraFlow))
    (record,) = patching.model_records(model.model_options)
    assert "family unknown (AuraFlow)" in record["note"]
    fast_path = fast_path_of(model)
    unet = TinyUNet()
    for seed in range(3):
        x, t, context = unet_inputs(seed)
        executor = Executor(unet)
        torch.testing.assert_close(fast_path(executor, x, t, context, None, None, {}), unet._forward(x, t, context), rtol=0, atol=0)
        assert executor.calls == 0
    (report,) = keyed_wrappers(model, FAST_PATH_KEY)["sampler_sample"]
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        report(lambda: None)
    (ran,) = run.optimizations
    assert "family unknown (AuraFlow)" in ran["note"]
    known = _compile_node(FastPatcher(SDXL))
    assert "family" not in patching.model_records(known.model_options)[0]["note"]
    (passed,) = SDOptCUDAGraph().patch(FastPatcher(AuraFlow), 4, "fallback")
    assert "family unknown" not in patching.model_records(passed.model_options)[0]["note"], "a node that runs nothing assumes nothing"


@torch.inference_mode()
def test_the_chain_runs_innermost_first_whatever_order_its_configs_come_in(patcher_extension):
    from sdopt.families import SD15 as SD15_FAMILY
    from sdopt.optim.compile import CompileConfig
    from sdopt.optim.cuda_graph import GraphConfig, GraphedFunction
    from sdopt.optim.step_cache import StepCacheConfig

    family = environment.ModelFamily(SD15_FAMILY, "SD15")
    configs = {GRAPH: GraphConfig(), COMPILE: CompileConfig("trace"), STEP_CACHE: StepCacheConfig()}
    fast_path = FastPath(configs, family)
    assert list(fast_path.configs) == [STEP_CACHE, COMPILE, GRAPH]
    # the graph captures what compile made, never the other way round
    fn, parts, _ = FastPath({GRAPH: GraphConfig(), COMPILE: CompileConfig("trace")}, family)._runner(TinyUNet(), {})
    assert isinstance(fn, GraphedFunction) and fn is parts[GRAPH] and fn.fn is parts[COMPILE]
    replaced = fast_path.with_config(COMPILE, None)
    assert list(replaced.configs) == [STEP_CACHE, GRAPH] and fast_path.config_of("SDOptCompile") is not None
    with pytest.raises(ValueError, match="not a member of the fast path's chain"):
        FastPath({"quantize": object()}, family)


@torch.inference_mode()
def test_a_new_member_joins_the_chain_at_its_place_and_writes_its_own_record(patcher_extension):
    """A forward technique the chain file does not name: one ChainMember, declared where its node is."""
    from sdopt.families import SD15 as SD15_FAMILY
    from sdopt.optim.compile import CompileConfig

    calls = []

    class Doubling(ChainMember):
        node, place = "SDOptDoubling", 25  # between compile (20) and graphs (30)

        def wrap(self, path, unet, fn, call, config, options):
            def doubled(*tensors):
                calls.append(len(tensors))
                return fn(*tensors) * config

            return doubled, doubled, None

        def record(self, path, config, state, parts, eager):
            return f"x{config} on {len(parts)} runner(s)", eager.note, eager.short

    doubling = Doubling()
    fast_path = FastPath({doubling: 2, COMPILE: CompileConfig("trace")}, environment.ModelFamily(SD15_FAMILY, "SD15"))
    assert list(fast_path.configs) == [COMPILE, doubling]
    fast_path.requested = {"SDOptDoubling": "x2"}
    unet = TinyUNet()
    x, t, context = unet_inputs()
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        fast_path.begin_run()
        out = fast_path(Executor(unet), x, t, context, None, None, {})
        fast_path.end_run()
    torch.testing.assert_close(out, 2 * unet._forward(x, t, context), rtol=0, atol=0)
    assert calls == [len(SD15_FAMILY.call.tensor_inputs)], "the member got the forward of the family's tensor inputs"
    (record,) = run.optimizations
    assert (record["node"], record["requested"], record["active"]) == ("SDOptDoubling", "x2", "x2 on 1 runner(s)")
    with pytest.raises(ValueError, match="at one place"):
        FastPath({doubling: 2, Doubling(): 3}, fast_path.family)


def test_regional_compile_leaves_a_blocks_place_out_only_where_nothing_in_the_call_reads_it():
    from sdopt.families import FLUX, SD15
    from sdopt.nodes.attention import OVERRIDE_KEY, comfy_attention_override
    from sdopt.nodes.compile import positionless_block_options
    from sdopt.optim.attention import AttentionConfig, build_attention

    ours = comfy_attention_override(build_attention(AttentionConfig(backend="sdpa")), lambda delegated=False: None)
    given = {"block": ("input", 4), "block_index": 1, "transformer_index": 2, "activations_shape": [2, 4, 8, 8],
             "original_shape": [2, 4, 8, 8], OVERRIDE_KEY: ours}
    for options in ({}, {OVERRIDE_KEY: ours}):
        handed = positionless_block_options(SD15, options)
        assert handed(given) == {"original_shape": [2, 4, 8, 8], OVERRIDE_KEY: ours}
        placeless = {"original_shape": [2, 4, 8, 8]}
        assert handed(placeless) is placeless, "options with no place in them are handed on as they are"
    assert positionless_block_options(SD15, {"patches_replace": {"attn2": {("input", 4): object()}}}) is None
    assert positionless_block_options(SD15, {OVERRIDE_KEY: lambda func, *args, **kwargs: func(*args, **kwargs)}) is None, \
        "another pack's override may read the place"
    assert positionless_block_options(FLUX, {}) is None, "a family whose blocks never read their place"
    assert positionless_block_options(None, {}) is None, "a family sdopt does not know"


def test_a_compile_and_graph_record_with_no_call_through_the_chain_says_so_in_its_summary(patcher_extension):
    from sdopt.families import SD15 as SD15_FAMILY
    from sdopt.optim.compile import CompileConfig
    from sdopt.optim.cuda_graph import GraphConfig

    fast_path = FastPath({COMPILE: CompileConfig("trace"), GRAPH: GraphConfig()}, environment.ModelFamily(SD15_FAMILY, "SD15"))
    fast_path.requested = {"SDOptCompile": "trace", "SDOptCUDAGraph": "max_graphs=4"}
    run = SamplingRun("r", "cpu")
    with run.memory_scope():
        fast_path.begin_run()
        fast_path.end_run()
    active = {r["node"]: r["active"] for r in run.optimizations}
    assert active == {"SDOptCompile": "trace: no call ran compiled", "SDOptCUDAGraph": "CUDA graph: no call ran from a graph"}

