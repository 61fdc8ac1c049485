"""``python -m sdopt bench speed``: the rungs of the fast path in ComfyUI's own KSampler, vs stock.

One process, one booted ComfyUI, one checkpoint. Every rung is a MODEL built by the nodes a user
would wire (each sdopt rung adds one node to the one before: precision auto, attention, then a
trace, compile, CUDA graph or compile + graph), plus ComfyUI's own TorchCompileModel as the
competitor. ``compile-alone`` is SDOptCompile wired straight after the checkpoint, the way a user
first tries it, against stock as its eager twin. ``compile+graph+channels_last`` (by ``rungs`` only: it compiles anew) is compile + graph
over Precision with channels-last conv weights. ``diffusers`` and ``diffusers+compile`` (by ``rungs``
only) are what a user would pick instead: diffusers' own UNet and pipeline on the same checkpoint's
weights, prompts and noise, with diffusers' speed recipe (``tools/diffusers_pipeline.py``).
``fp8_e4m3fn_fast`` (by ``rungs`` only) is ComfyUI's own fp8 fast path, the competitor of
Precision's ``fp8_matmul``: the diffusion model loaded as Load Diffusion Model loads it with that
weight dtype. Each
ComfyUI rung is profiled by SDOptProfiler and sampled by ``common_ksampler``:

1. a warm-up prompt per rung, whose extra time over its median steady prompt is its compile/capture
   time (the same measure for sdopt's rungs and for TorchCompileModel);
2. ``rounds`` rounds that run every rung once, interleaved (A/B/A/B), so drift hits all alike;
   a rung's speedup in a round is its steady it/s over stock's in that same round.

The image of each rung is decoded once and compared with stock's (max pixel difference on 0–255),
and a traced, compiled or graphed rung's also with its eager twin's, the same nodes without trace,
compile or graph, against ``IMAGE_TOLERANCE``.

With ``profile``, each rung then samples one more prompt under torch.profiler
(``measure.step_profile``): the device's busy time per step set beside the steady step time says
whether the device or the host bounds the step, with the host syncs and the costliest kernels, each
op category's share of the step and the ops that ran outside compiled graphs; ``trace_dir`` keeps each of those prompts as a Perfetto trace.

Rungs that share a process share torch's compiler: a later compiling rung reuses kernels an earlier one
built, so compile times depend on the rungs' order. ``bench_speed_isolated`` (``--isolate``) runs each
rung in a fresh process beside a stock run of its own, with empty compiler caches (sdopt's, inductor's,
Triton's): every rung's compile time is cold and its own, and its speedup is against its own process's
stock.

``model`` is a generated model (``mini``, ``sdxl-mini``, ...) or a checkpoint file. The prompt is
encoded with the image size beside it, as ComfyUI's CLIPTextEncodeSDXL does: a family whose
diffusion model takes a size vector (SDXL's ``y``) embeds it, the others ignore it.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
import uuid
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..errors import UserError
from ..measure.profiler import MEMORY_LABELS, format_mib
from ..measure.report import markdown_table, outside_allocator_suffix
from ..measure.step_profile import profile_device
from ..optim.precision import dtype_name
from .bench_unet import checkpoint_path, load_checkpoint, memory_mode_lines
from .bench_vae import image_psnr
from .fresh_process import run_in_fresh_process, serve_child
from .progress import progress_bar

PROMPT = "a lighthouse on a cliff at dusk, highly detailed"
SEED, CFG, SAMPLER, SCHEDULER = 42, 7.0, "euler", "normal"
STOCK = "stock"
COMPILE_ALONE = "compile-alone"
# Each repeated block compiled once and shared (a DiT's identical blocks), beside the whole-model compile.
COMPILE_REGIONAL = "compile_regional"
RUNGS = ("stock", "precision", "attention", "trace", "compile", "graph", "compile+graph", COMPILE_ALONE, "TorchCompileModel")
CHANNELS_LAST = "compile+graph+channels_last"
DIFFUSERS, DIFFUSERS_COMPILE = "diffusers", "diffusers+compile"
# Step caches change the image by design: their rows give the difference from the uncached twin
# (and its PSNR) without holding it to IMAGE_TOLERANCE.
CACHE, COMPILED_CACHE, EASYCACHE, COMPILED_EASYCACHE = "cache", "compile+graph+cache", "EasyCache", "compile+graph+EasyCache"
CACHE_RUNGS = (CACHE, COMPILED_CACHE, EASYCACHE, COMPILED_EASYCACHE)
# Asked for by --rungs only: the channels-last rung compiles anew; the diffusers rungs run diffusers' own
# UNet and pipeline on the same checkpoint's weights (tools/diffusers_pipeline.py), the competitor recipe.
# fp8 e4m3 weights multiplied in fp8 (Precision's fp8_matmul): its image differs from the half-precision
# one by the activations' and weights' e4m3 rounding, reported against the attention rung, not held.
FP8_MATMUL_RUNG = "fp8_matmul"
# The fp8 stack compiled and graphed, against the fp8 rung, its eager twin. Not held to the tolerance:
# fp8_linear compiles bitwise, but any fp32 reassociation inductor makes around it moves an activation
# across an e4m3 rounding boundary (a step of 6-12%), and random weights amplify each such flip (the SD3.5
# mini at 256², 4 steps, on a CPU: 48.8 / 6.9 levels from eager fp8).
FP8_COMPILED_RUNG = "fp8_matmul+compile+graph"
# ComfyUI's own "fp8 fast", the competitor of fp8_matmul: the checkpoint's diffusion model loaded as Load
# Diffusion Model's weight_dtype fp8_e4m3fn_fast loads it (fp8 weights, and fp8 matmuls where ComfyUI's
# supports_fp8_compute says the device has them, activations clamped at ±448), against stock.
COMFY_FP8_FAST = "fp8_e4m3fn_fast"
# sdopt Auto with its defaults (fastest, exact): the stack it picks, against the best rung wired by hand.
AUTO = "auto"
OFFERED_RUNGS = RUNGS + (AUTO, COMPILE_REGIONAL, CHANNELS_LAST, DIFFUSERS, DIFFUSERS_COMPILE, FP8_MATMUL_RUNG, FP8_COMPILED_RUNG,
                         COMFY_FP8_FAST) + CACHE_RUNGS
# The rungs that compile with inductor: before the first of them runs, a tiny compile pays torch's
# per-process start-up (compile workers, precompiled header, imports), so no rung's compile time holds it.
COMPILING_RUNGS = (AUTO, "compile", "compile+graph", COMPILE_ALONE, COMPILE_REGIONAL, CHANNELS_LAST, "TorchCompileModel", DIFFUSERS_COMPILE,
                   COMPILED_CACHE, COMPILED_EASYCACHE, FP8_COMPILED_RUNG)
SAMPLING_SPAN = "sdopt.bench: sampler"
CHANNELS_LAST_EAGER = "attention+channels_last"


@dataclass(frozen=True)
class ImageTolerance:
    """How far a rung's image may be from its eager twin's, in levels of 0–255."""

    max_levels: float
    mean_levels: float

    def admits(self, max_levels: float, mean_levels: float) -> bool:
        return max_levels <= self.max_levels and mean_levels <= self.mean_levels


# Inductor and the graph reorder half-precision reductions, and 20 steps amplify the rounding: on the
# CPU machine in bf16 (mini, 128 px, 20 steps) compiled rungs were 4.8–8.8 levels off their eager twin
# at most and 0.6–1.1 on average, as far as swapping the eager attention kernel moves the image
# (9.1, 1.1). The tolerance is about twice that; fp16 rounds finer than bf16.
IMAGE_TOLERANCE = ImageTolerance(max_levels=16.0, mean_levels=2.0)


def pixel_difference(image: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max, mean) absolute difference of two images in [0, 1], in levels of 0–255."""
    levels = (image - reference).abs() * 255
    return float(levels.max()), float(levels.mean())


@dataclass
class Rung:
    model: object
    nodes: str
    eager: str = ""  # the eager twin whose image this rung's must match; "" for a rung that is eager itself
    eager_model: object = None
    sample: object = None  # a DiffusersSampler that samples instead of ComfyUI's KSampler; model is then the ComfyUI model whose latent format it shares
    approximate: bool = False  # a step cache or fp8 matmuls: its image is compared with the eager twin's, not held to the tolerance
    note: str = ""  # what ran, for a rung that no sdopt node records


@dataclass
class SpeedRow:
    rung: str
    nodes: str
    steady_it_per_s: float
    speedup_median: float
    speedup_min: float
    speedup_max: float
    first_run_s: float
    compile_s: float
    sampler_s: float
    decode_s: float
    end_to_end_s: float
    peak_memory_bytes: int
    memory_kind: str
    max_pixel_diff: float
    device: str
    notes: str = ""
    rounds_it_per_s: list = field(default_factory=list)
    vram_cap_bytes: int | None = None  # --vram-cap in force
    step_profile: dict | None = None  # StepBreakdown.to_dict() of a profiled prompt (--profile)
    eager_twin: str = ""
    max_pixel_diff_vs_eager: float | None = None
    mean_pixel_diff_vs_eager: float | None = None
    within_tolerance: bool | None = None  # of IMAGE_TOLERANCE, against the eager twin
    psnr_vs_eager_db: float | None = None  # the approximate rungs' (step caches) PSNR against their uncached twin
    inductor_start_up_s: float | None = None  # stock's row: the tiny compile run before the first compiling rung
    isolated: bool = False  # ran in a fresh process beside its own stock run, compiler caches empty (--isolate)
    memory_mode: str | None = None  # Report.memory_mode of the process: dynamic VRAM, classic memory, None (no dynamic VRAM here)
    peak_outside_allocator_bytes: int | None = None  # under dynamic VRAM: what aimdo mapped past PyTorch's allocator

    def to_dict(self) -> dict:
        return asdict(self)


def _sdopt_rungs(host, base, names: list[str]) -> dict[str, Rung]:
    """{rung: Rung}; sdopt rungs stack on precision + attention, and each traced, compiled or graphed
    rung names the eager stack under it as its twin."""
    node = host.node_classes

    def attention_over_precision(channels_last: bool):
        precision = node["SDOptPrecision"]().patch(base, "auto", "default", False, channels_last)[0]
        return precision, node["SDOptAttention"]().patch(precision, "sdpa", "fallback", 0, 32)[0]

    precision, attention = attention_over_precision(False)
    stack = "Precision(auto) → Attention(sdpa)"

    def compile_(model, mode):
        return node["SDOptCompile"]().patch(model, mode, "inductor", "default", False, False, "fallback")[0]

    def graph(model):
        return node["SDOptCUDAGraph"]().patch(model, 4, "fallback")[0]

    def over_attention(model, nodes, approximate=False):
        return Rung(model, f"{stack} → {nodes}", "attention", attention, approximate=approximate)

    # a transformer (a family with block groups) caches with first_block, which regional compile
    # runs beside; a UNet with DeepCache, which compile and CUDA graphs capture
    from ..nodes.step_cache import block_groups

    transformer = bool(block_groups(base))
    cache_mode = "first_block" if transformer else "deepcache"
    cache_nodes = "StepCache(first_block, threshold 0.08)" if transformer else "StepCache(deepcache, interval 3)"

    # The settings every figure of these rungs was measured with (interval 3, DeepCache's published one;
    # threshold 0.08), kept so the rows stay comparable; the node's defaults come from bench quality.
    def step_cache(model):
        return node["SDOptStepCache"]().patch(model, cache_mode, 3, 0, 0.0, 1.0, "fallback", 0.08)[0]

    def compiled_cache():
        if transformer:
            return over_attention(compile_(step_cache(attention), "compile_regional"), f"{cache_nodes} → Compile(compile_regional)",
                                  approximate=True)
        return over_attention(graph(compile_(step_cache(attention), "compile")), f"{cache_nodes} → Compile(compile) → CUDAGraph",
                              approximate=True)

    def easycache(model):
        if "EasyCache" not in node:
            raise UserError("--rungs EasyCache: this ComfyUI has no EasyCache node (it came with ComfyUI 0.3.50); leave the rung out")
        return node["EasyCache"].execute(model, 0.2, 0.15, 0.95, False).result[0]

    fp8_stack = "Precision(fp8_e4m3fn, fp8_matmul) → Attention(sdpa)"

    @functools.cache
    def fp8_attention():
        fp8 = node["SDOptPrecision"]().patch(base, "fp8_e4m3fn", "fp8_matmul", False, False)[0]
        return node["SDOptAttention"]().patch(fp8, "sdpa", "fallback", 0, 32)[0]

    def channels_last():
        eager = attention_over_precision(True)[1]
        return Rung(graph(compile_(eager, "compile")),
                    "Precision(auto, channels_last) → Attention(sdpa) → Compile(compile) → CUDAGraph", CHANNELS_LAST_EAGER, eager)

    makers = {
        STOCK: lambda: Rung(base, "—"),
        "precision": lambda: Rung(precision, "Precision(auto)"),
        "attention": lambda: Rung(attention, stack),
        "trace": lambda: over_attention(compile_(attention, "trace"), "Compile(trace)"),
        "compile": lambda: over_attention(compile_(attention, "compile"), "Compile(compile)"),
        COMPILE_REGIONAL: lambda: over_attention(compile_(attention, "compile_regional"), "Compile(compile_regional)"),
        "graph": lambda: over_attention(graph(attention), "CUDAGraph"),
        "compile+graph": lambda: over_attention(graph(compile_(attention, "compile")), "Compile(compile) → CUDAGraph"),
        CHANNELS_LAST: channels_last,
        COMPILE_ALONE: lambda: Rung(compile_(base, "compile"), "Compile(compile)", STOCK, base),
        AUTO: lambda: Rung(node["SDOptAuto"]().apply(base, "fastest", False, 0)[0], "Auto(fastest)", STOCK, base),
        FP8_MATMUL_RUNG: lambda: Rung(fp8_attention(), fp8_stack, "attention", attention, approximate=True),
        FP8_COMPILED_RUNG: lambda: Rung(graph(compile_(fp8_attention(), "compile")), f"{fp8_stack} → Compile(compile) → CUDAGraph",
                                        FP8_MATMUL_RUNG, fp8_attention(), approximate=True),
        "TorchCompileModel": lambda: Rung(_comfy_torch_compile(base), "ComfyUI TorchCompileModel(inductor)", STOCK, base),
        CACHE: lambda: over_attention(step_cache(attention), cache_nodes, approximate=True),
        COMPILED_CACHE: compiled_cache,
        EASYCACHE: lambda: Rung(easycache(base), "ComfyUI EasyCache(0.2, 15–95%)", STOCK, base, approximate=True),
        COMPILED_EASYCACHE: lambda: over_attention(graph(compile_(easycache(attention), "compile")),
                                                   "ComfyUI EasyCache(0.2, 15–95%) → Compile(compile) → CUDAGraph", approximate=True),
    }
    return {name: makers[name]() for name in names}


def _comfy_torch_compile(base):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    model = base.clone()
    set_torch_compile_wrapper(model=model, backend="inductor")
    return model


def _sampling_spanned(model):
    """A clone whose sampler run is one ``record_function`` range: the step profile counts the host
    syncs inside it, not those of the prompt's set-up."""
    import comfy.patcher_extension

    def span(executor, *args, **kwargs):
        with torch.profiler.record_function(SAMPLING_SPAN):
            return executor(*args, **kwargs)

    clone = model.clone()
    clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE, SAMPLING_SPAN, span)
    return clone


def encode_prompts(clip, size: int) -> tuple:
    """(positive, negative) conditioning of ``PROMPT`` and the empty prompt for a ``size``² image,
    uncropped, as CLIPTextEncodeSDXL gives it."""
    import node_helpers
    import nodes

    encode = nodes.CLIPTextEncode().encode
    sizes = {"width": size, "height": size, "crop_w": 0, "crop_h": 0, "target_width": size, "target_height": size}
    return tuple(node_helpers.conditioning_set_values(encode(clip, text)[0], sizes) for text in (PROMPT, ""))


def empty_latent(model, size: int) -> dict:
    """The latent an EmptyLatentImage of ``size``² gives ``model``'s family."""
    channels = model.model.latent_format.latent_channels
    return {"samples": torch.zeros(1, channels, size // 8, size // 8)}


# A server keeps a Profiler's output between prompts while nothing before it changes, so each rung's prompts
# sample one profiled model, as there: a node that keeps state per model it is handed (Auto's stacks) sees one.
_PROFILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def profiled_sample(host, model, label: str, latent: dict, conds, steps: int):
    """(latent, the profiler's run, seconds from call to return) of one KSampler prompt."""
    import nodes
    from comfy_execution.utils import CurrentNodeContext

    by_label = _PROFILED.setdefault(model, {})
    if label not in by_label:
        by_label[label] = host.node_classes["SDOptProfiler"]().apply(model, label)[0]
    profiled = by_label[label]
    prompt_id = f"bench-{uuid.uuid4().hex}"
    with CurrentNodeContext(prompt_id, "1"):
        started = time.perf_counter()
        out = nodes.common_ksampler(profiled, SEED, steps, CFG, SAMPLER, SCHEDULER, conds[0], conds[1], latent)[0]["samples"]
        if out.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    (run,) = host.pack("nodes.prompt_context").prompt_log(prompt_id).runs
    return out, run, wall


def _diffusers_rungs(base, path: Path, model: str, names: list[str]) -> dict[str, Rung]:
    """diffusers' recipe on the checkpoint's weights and ComfyUI's noise schedule; one UNet for both rungs,
    and the compiled rung's eager twin is the plain one."""
    if not names:
        return {}
    from .diffusers_pipeline import NoiseSchedule, build_samplers

    sampling = base.get_model_object("model_sampling")
    schedule = NoiseSchedule(sampling.num_timesteps, sampling.linear_start, sampling.linear_end)
    samplers = build_samplers(path, model, base.load_device, schedule, tuple(name == DIFFUSERS_COMPILE for name in names))
    return {name: Rung(base, f"diffusers UNet2DConditionModel and {type(sampler.pipeline).__name__}, the checkpoint's weights",
                       DIFFUSERS if name == DIFFUSERS_COMPILE else "", sample=sampler)
            for name, sampler in zip(names, samplers)}


def _comfy_fp8_fast(base, path: Path) -> Rung:
    """The checkpoint's diffusion model as ComfyUI's Load Diffusion Model loads it with weight_dtype
    fp8_e4m3fn_fast, and whether ComfyUI's fp8 matmuls run on this device."""
    import comfy.model_management
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn, "fp8_optimizations": True})
    device = torch.device(base.load_device)
    computes = dtype_name(model.model.manual_cast_dtype or model.model_dtype())
    if comfy.model_management.supports_fp8_compute(device):
        note = f"ComfyUI's fp8 matmuls (activations clamped at ±448), the rest in {computes}"
    else:
        note = f"ComfyUI runs no fp8 matmul on {device} (its supports_fp8_compute says no): fp8 weights upcast per layer to {computes}"
    return Rung(model, "Load Diffusion Model(fp8_e4m3fn_fast)", STOCK, base, approximate=True, note=note)


def sample_rung(host, rung: Rung, label: str, latent: dict, conds, steps: int, spanned: bool = False):
    """``profiled_sample`` for a ComfyUI rung; for a diffusers rung, its pipeline on the same prompts'
    embeddings and KSampler's noise, the latent brought into ComfyUI's LATENT space by the model's latent
    format. ``spanned``: the sampler run is one ``SAMPLING_SPAN`` range, for the step profile."""
    if rung.sample is None:
        return profiled_sample(host, _sampling_spanned(rung.model) if spanned else rung.model, label, latent, conds, steps)
    import comfy.sample

    def embeds(cond):
        return {"embeds": cond[0][0], "pooled": cond[0][1].get("pooled_output")}

    noise = comfy.sample.prepare_noise(latent["samples"], SEED)
    with torch.profiler.record_function(SAMPLING_SPAN) if spanned else contextlib.nullcontext():
        latents, run, wall = rung.sample.sample(embeds(conds[0]), embeds(conds[1]), noise, steps, CFG)
    return rung.model.model.latent_format.process_out(latents), run, wall


def timed_decode(vae, samples) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    image = vae.decode(samples)
    if image.device.type == "cuda":
        torch.cuda.synchronize()
    return image.float().cpu(), time.perf_counter() - started


def optimization_notes(records: list[dict]) -> str:
    """What each sdopt node requested and really ran, as one line, from its records."""
    return "; ".join(f"{o['node']}: {o['active']}" + (f" ({o['note']})" if o.get("note") else "") for o in records)


def _rung_names(size: int, steps: int, rounds: int, rungs: list[str]) -> list[str]:
    """Stock, then the other requested rungs; a UserError naming the option that is out of range."""
    if size % 64 or size < 64:
        raise UserError(f"--size must be a positive multiple of 64, not {size}")
    if steps < 2 or rounds < 1:
        raise UserError("--steps must be >= 2 (the first step is warm-up) and --rounds >= 1")
    unknown = [r for r in rungs if r not in OFFERED_RUNGS]
    if unknown:
        raise UserError(f"--rungs: unknown {', '.join(unknown)}; choose from {', '.join(OFFERED_RUNGS)}")
    return [STOCK] + [r for r in rungs if r != STOCK]


@torch.inference_mode()
def bench_speed(
    comfyui: Path,
    model: str = "mini",
    size: int = 512,
    steps: int = 20,
    rounds: int = 3,
    rungs: list[str] = RUNGS,
    models: Path | None = None,
    progress: bool = True,
    vram_cap: int | None = None,
    profile: bool = False,
    trace_dir: Path | None = None,
) -> list[SpeedRow]:
    from .headless import boot

    names = _rung_names(size, steps, rounds, rungs)
    if DIFFUSERS_COMPILE in names and DIFFUSERS not in names:  # its eager twin
        names.insert(names.index(DIFFUSERS_COMPILE), DIFFUSERS)
    profile = profile or trace_dir is not None
    host = boot(comfyui, vram_cap)
    path = checkpoint_path(model, Path(models) if models is not None else Path(host.path) / "models")
    base, clip, vae = load_checkpoint(path)
    conds = encode_prompts(clip, size)
    latent = empty_latent(base, size)
    built = _sdopt_rungs(host, base, [n for n in names if n not in (DIFFUSERS, DIFFUSERS_COMPILE, COMFY_FP8_FAST)])
    built.update(_diffusers_rungs(base, path, model, [n for n in names if n in (DIFFUSERS, DIFFUSERS_COMPILE)]))
    if COMFY_FP8_FAST in names:
        built[COMFY_FP8_FAST] = _comfy_fp8_fast(base, path)
    first, images, decode, runs = {}, {}, {}, {name: [] for name in names}
    twins = {rung.eager: rung.eager_model for rung in built.values() if rung.eager and rung.eager not in built}
    start_up_s = warm_inductor(torch.device(base.load_device)) if any(n in COMPILING_RUNGS for n in names) else None
    bar = progress_bar(total=len(names) * (rounds + 1 + profile) + len(twins), desc=f"speed {path.stem} {size}px {steps} steps", unit="run", disable=not progress)
    for name in names:
        samples, run, wall = sample_rung(host, built[name], name, latent, conds, steps)
        first[name] = (wall, run)
        images[name] = timed_decode(vae, samples)[0]
        bar.update()
    for name, model in twins.items():
        images[name] = timed_decode(vae, profiled_sample(host, model, name, latent, conds, steps)[0])[0]
        bar.update()
    for _ in range(rounds):
        for name in names:
            samples, run, wall = sample_rung(host, built[name], name, latent, conds, steps)
            runs[name].append((wall, run))
            decode[name] = timed_decode(vae, samples)[1]
            bar.update()
    profiles = {}
    for name in names if profile else ():
        trace = Path(trace_dir) / f"{name}.trace.json.gz" if trace_dir else None
        _, activity = profile_device(lambda: sample_rung(host, built[name], name, latent, conds, steps, spanned=True), base.load_device, trace, SAMPLING_SPAN)
        profiles[name] = activity.per_step(steps, 1 / statistics.median(r["steady_it_per_s"] for _, r in runs[name]))
        bar.update()
    bar.close()
    rows = []
    stock_rates = [run["steady_it_per_s"] for _, run in runs[STOCK]]
    for name in names:
        rates = [run["steady_it_per_s"] for _, run in runs[name]]
        speedups = [rate / stock for rate, stock in zip(rates, stock_rates)]
        steady_wall = statistics.median(wall for wall, _ in runs[name])
        last = runs[name][-1][1]
        sampler_s = statistics.median(run["sampler_total_s"] for _, run in runs[name])
        eager, approximate = built[name].eager, built[name].approximate
        vs_eager = pixel_difference(images[name], images[eager]) if eager else (None, None)
        outside = [run.get("peak_outside_allocator_bytes") for _, run in runs[name]]
        rows.append(SpeedRow(
            rung=name, nodes=built[name].nodes, steady_it_per_s=statistics.median(rates),
            speedup_median=statistics.median(speedups), speedup_min=min(speedups), speedup_max=max(speedups),
            first_run_s=first[name][0], compile_s=max(0.0, first[name][0] - steady_wall),
            sampler_s=sampler_s, decode_s=decode[name], end_to_end_s=sampler_s + decode[name],
            peak_memory_bytes=max(run["peak_memory_bytes"] for _, run in runs[name]), memory_kind=last["memory_kind"],
            max_pixel_diff=pixel_difference(images[name], images[STOCK])[0], device=str(base.load_device),
            notes="; ".join(filter(None, (built[name].note, optimization_notes(last["optimizations"])))), rounds_it_per_s=rates, vram_cap_bytes=host.vram_cap_bytes,
            step_profile=profiles[name].to_dict() if name in profiles else None,
            eager_twin=eager, max_pixel_diff_vs_eager=vs_eager[0], mean_pixel_diff_vs_eager=vs_eager[1],
            within_tolerance=IMAGE_TOLERANCE.admits(*vs_eager) if eager and not approximate else None,
            psnr_vs_eager_db=image_psnr(images[name], images[eager]) if approximate else None,
            inductor_start_up_s=start_up_s if name == STOCK else None, memory_mode=host.memory_mode.label,
            peak_outside_allocator_bytes=max((b for b in outside if b is not None), default=None),
        ))
    return rows


# Where each isolated rung's compilers keep their caches: sdopt's compile cache (optim/compile/cache.py), and
# inductor's and Triton's own for what compiles outside it (ComfyUI's TorchCompileModel, diffusers).
COMPILER_CACHE_VARIABLES = ("SDOPT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def bench_speed_isolated(comfyui: Path, model: str = "mini", size: int = 512, steps: int = 20, rounds: int = 3,
                         rungs: list[str] = RUNGS, models: Path | None = None, progress: bool = True, **options) -> list[SpeedRow]:
    """``bench_speed`` with each rung in a fresh process beside a stock run of its own, every compiler cache
    an empty folder: the first process's stock row, then each rung's row. ``options``: ``bench_speed``'s others."""
    from .headless import _check_comfyui

    names = _rung_names(size, steps, rounds, rungs)[1:]
    root = _check_comfyui(Path(comfyui) if comfyui else None)
    models = Path(models) if models is not None else root / "models"
    checkpoint_path(model, models)  # a generated model is written once, here, rather than by the first child
    if not names:
        return bench_speed(root, model, size, steps, rounds, [STOCK], models, progress, **options)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="sdopt-bench-speed-") as caches:
            spec = {**options, "comfyui": str(root), "model": model, "models": str(models), "size": size, "steps": steps,
                    "rounds": rounds, "rungs": [STOCK, name], "progress": progress}
            spec = {key: str(value) if isinstance(value, Path) else value for key, value in spec.items()}
            env = {variable: str(Path(caches) / variable.lower()) for variable in COMPILER_CACHE_VARIABLES}
            child = [SpeedRow(**row) for row in run_in_fresh_process(__spec__.name, spec, f"the {name} rung", env=env,
                                                                      show_progress=progress)]
        rows += [replace(row, isolated=True) for row in child if row.rung == name or (row.rung == STOCK and not rows)]
    return rows


def _sampled_in_this_process(spec: dict) -> list[dict]:
    return [row.to_dict() for row in bench_speed(**spec)]


def warm_inductor(device: torch.device) -> float | None:
    """Seconds of doctor's tiny inductor compile on ``device``; None where it cannot compile (the
    compiling rungs then say why in their records)."""
    from ..nodes.checks import compile_trial

    started = time.perf_counter()
    try:
        compile_trial(device)
    except Exception:  # no compiler or no Triton: each compiling rung's node reports it
        return None
    return time.perf_counter() - started


def speed_table(rows: list[SpeedRow]) -> str:
    headers = ["rung", "steady it/s", "speedup vs stock (median, min–max)", "first run s", "compile/capture s",
               "sampler + decode s", "peak memory", "max pixel diff", "vs eager twin: max / mean"]
    body = [
        [r.rung, f"{r.steady_it_per_s:.2f}", f"{r.speedup_median:.2f}x ({r.speedup_min:.2f}–{r.speedup_max:.2f})",
         f"{r.first_run_s:.1f}", f"{r.compile_s:.1f}", f"{r.sampler_s:.3f} + {r.decode_s:.3f}",
         _peak(r), f"{r.max_pixel_diff:.1f}", _vs_eager(r)]
        for r in rows
    ]
    notes = [f"- **{r.rung}** ({r.nodes}): {r.notes or 'stock ComfyUI'}" for r in rows]
    tolerance = (f"Eager twin: the same nodes without trace, compile or graph; tolerance: at most {IMAGE_TOLERANCE.max_levels:g} "
                 f"levels of 0–255 anywhere and {IMAGE_TOLERANCE.mean_levels:g} on average.")
    start_up = [r.inductor_start_up_s for r in rows if r.inductor_start_up_s is not None]
    if any(r.isolated for r in rows):
        tolerance += (" Each rung ran in a fresh process beside a stock run of its own, with empty compiler caches (--isolate): "
                      "its compile time is cold and its own (a tiny compile first paid torch's per-process start-up), its speedup "
                      "is against that process's stock; the stock row is the first process's.")
    elif start_up:
        tolerance += (f" Before the first compiling rung a tiny compile took {start_up[0]:.1f} s, torch's per-process start-up: "
                      "no rung's compile time holds it (a later rung may still reuse kernels an earlier one compiled).")
    return "\n".join(markdown_table(headers, body, right={1, 2, 3, 4, 5, 6, 7, 8}) + ["", *notes, "", tolerance] + memory_mode_lines(rows))


def _peak(row: SpeedRow) -> str:
    return f"{format_mib(row.peak_memory_bytes)} {MEMORY_LABELS[row.memory_kind]}{outside_allocator_suffix(row.peak_outside_allocator_bytes)}"


def _vs_eager(row: SpeedRow) -> str:
    if not row.eager_twin:
        return "— (eager)"
    if row.psnr_vs_eager_db is not None:
        return (f"{row.max_pixel_diff_vs_eager:.1f} / {row.mean_pixel_diff_vs_eager:.2f}, PSNR {row.psnr_vs_eager_db:.1f} dB "
                f"(approximate by design: not held to the tolerance; {row.eager_twin})")
    verdict = "ok" if row.within_tolerance else "OUT OF TOLERANCE"
    return f"{row.max_pixel_diff_vs_eager:.1f} / {row.mean_pixel_diff_vs_eager:.2f} {verdict} ({row.eager_twin})"


def step_profiles(rows: list[SpeedRow]) -> dict[str, dict]:
    """{rung: its step profile} of the profiled rungs, for ``measure.step_profile``'s tables."""
    return {row.rung: row.step_profile for row in rows if row.step_profile}


def save_plot(rows: list[SpeedRow], path: Path) -> str | None:
    """A bar chart of steady it/s per rung; None, or why not (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: pip install matplotlib"
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    names = [r.rung for r in rows][::-1]
    rates = [r.steady_it_per_s for r in rows][::-1]
    competitors = (STOCK, "TorchCompileModel", DIFFUSERS, DIFFUSERS_COMPILE)
    bars = ax.barh(names, rates, color=["#999" if n in competitors else "#2a7" for n in names])
    for bar, row in zip(bars, rows[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row.steady_it_per_s:.1f} it/s ({row.speedup_median:.2f}x)", va="center", fontsize=8)
    ax.set_xlabel("steady it/s in ComfyUI's KSampler (higher is better)")
    ax.set_title(f"sdopt bench speed on {rows[0].device}")
    ax.set_xlim(0, max(rates) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


if __name__ == "__main__":
    serve_child(_sampled_in_this_process)
