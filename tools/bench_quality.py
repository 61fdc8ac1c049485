"""``python -m sdopt bench quality``: what each setting costs in image quality on a reference model, beside
what it buys in speed and in model calls.

One booted ComfyUI, one reference checkpoint (``ref-sd15``, ...), the same (caption, seed) pairs for every
rung, sampled through ComfyUI's own nodes at the reference's default settings. Per rung:

- seconds per image (the sampler) and the speed against stock;
- the model calls each image cost, counted as the share of the diffusion model's parameters each call ran
  (a step cache that runs part of the model counts part of a call), so a cached rung's saving is measured,
  not assumed; a compiled rung runs code no hook sees, and is not counted;
- the prompt accuracy (``tools/reference/classifier``): shape and colour right, and every attribute right;
- PSNR and SSIM (torchmetrics) of each image against stock's image of the same seed.

Every rung that changes the image is set beside the fewer-steps baseline: stock at the number of steps
that costs the same model calls, the row the caching papers use as the honest comparison.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import UserError
from ..families import MODEL_NAMES, checkpoint_config
from .bench_unet import checkpoint_path, load_checkpoint
from .progress import progress_bar
from .reference.evaluate import Sampling, caption_accuracy, evaluation_set, sample_images

STOCK = "stock"
# The lossless rungs, whose accuracy must equal stock's.
LOSSLESS = ("attention", "compile")
DEEPCACHE_INTERVALS = (2, 3, 4, 5)
FIRST_BLOCK_THRESHOLDS = (0.05, 0.08, 0.12, 0.2)
COMFY_CACHES = ("EasyCache", "LazyCache")


@dataclass
class QualityRow:
    rung: str
    nodes: str
    images: int
    seconds_per_image: float
    speed_vs_stock: float
    model_calls_per_image: float | None
    shape_colour: float
    all_attributes: float
    psnr_db: float | None
    ssim: float | None
    lossless: bool = False
    baseline_of: str = ""  # a fewer-steps row: the rungs whose model calls it matches
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def image_distance(images: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Mean PSNR (dB) and SSIM of each image against the reference image of the same seed."""
    try:
        from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure
    except ImportError:
        raise UserError("bench quality needs torchmetrics for PSNR and SSIM: pip install 'torchmetrics>=1.0'") from None
    preds, target = images.movedim(-1, 1).float(), reference.movedim(-1, 1).float()
    psnr = peak_signal_noise_ratio(preds, target, data_range=1.0, reduction="none", dim=(1, 2, 3))
    # An image equal to its reference has infinite PSNR; 100 dB stands for "identical" in the mean.
    psnr = torch.nan_to_num(psnr, posinf=100.0).clamp(max=100.0)
    ssim = structural_similarity_index_measure(preds, target, data_range=1.0)
    return float(psnr.mean()), float(ssim)


class ModelCallCounter:
    """Counts what a diffusion model ran: each call of a leaf module with parameters adds that module's
    share of the model's parameters, so one whole call adds 1."""

    def __init__(self, diffusion_model: torch.nn.Module):
        self.leaves = [module for module in diffusion_model.modules()
                       if not list(module.children()) and any(True for _ in module.parameters(recurse=False))]
        self.total = sum(parameter.numel() for module in self.leaves for parameter in module.parameters(recurse=False))
        self.calls = 0.0
        self._handles = []

    def __enter__(self):
        for module in self.leaves:
            share = sum(parameter.numel() for parameter in module.parameters(recurse=False)) / self.total
            self._handles.append(module.register_forward_hook(lambda *_, share=share: self._add(share)))
        return self

    def _add(self, share: float) -> None:
        self.calls += share

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _rung_models(host, base, transformer: bool, on_cpu: bool) -> dict:
    """{rung: (model, nodes)} for every rung this model and device can run, each one node on stock."""
    node = host.node_classes

    def precision(weight: str, compute: str):
        return node["SDOptPrecision"]().patch(base, weight, compute, False, False)[0]

    def cache(mode: str, interval: int, threshold: float):
        return node["SDOptStepCache"]().patch(base, mode, interval, 0, 0.0, 1.0, "error", threshold)[0]

    rungs = {
        STOCK: (base, "—"),
        "attention": (node["SDOptAttention"]().patch(base, "sdpa", "error", 0, 32)[0], "Attention(sdpa)"),
        "compile": (node["SDOptCompile"]().patch(base, "compile", "inductor", "default", False, False, "error")[0],
                    "Compile(compile)"),
    }
    if transformer:
        for threshold in FIRST_BLOCK_THRESHOLDS:
            rungs[f"first_block {threshold:g}"] = (cache("first_block", 3, threshold), f"StepCache(first_block, threshold {threshold:g})")
    else:
        for interval in DEEPCACHE_INTERVALS:
            rungs[f"deepcache {interval}"] = (cache("deepcache", interval, 0.08), f"StepCache(deepcache, interval {interval})")
    for name in COMFY_CACHES:
        if name in node:
            rungs[name] = (node[name].execute(base, 0.2, 0.15, 0.95, False).result[0], f"ComfyUI {name}(0.2, 15–95%)")
    rungs["bf16"] = (precision("bf16", "bf16"), "Precision(bf16, bf16)")
    rungs["fp8_weights"] = (precision("fp8_e4m3fn", "default"), "Precision(fp8_e4m3fn, default)")
    # On a CPU torch._scaled_mm runs in its fp32 emulation: the numbers of fp8 matmuls, not their speed.
    rungs["fp8_compute"] = (precision("fp8_e4m3fn", "fp8_matmul"), "Precision(fp8_e4m3fn, fp8_matmul)")
    if not on_cpu:
        rungs["sage"] = (node["SDOptAttention"]().patch(base, "sage", "error", 0, 32)[0], "Attention(sage)")
    return rungs


def _row(rung: str, nodes: str, pairs, images, seconds: float, calls: float | None, reference, stock_seconds: float | None,
         **extra) -> QualityRow:
    accuracy = caption_accuracy(images, pairs)
    psnr, ssim = image_distance(images, reference) if reference is not None else (None, None)
    per_image = seconds / len(pairs)
    return QualityRow(rung, nodes, len(pairs), per_image, (stock_seconds / per_image) if stock_seconds else 1.0,
                      None if calls is None else calls / len(pairs), accuracy["shape_colour"], accuracy["all"], psnr, ssim, **extra)


def bench_quality(comfyui: Path, model: str = "ref-sd15", *, images: int = 32, rungs: list[str] | None = None,
                  models: Path | None = None, sampling: Sampling = Sampling()) -> list[QualityRow]:
    """The rows of ``bench quality`` on reference model ``model`` over ``images`` (caption, seed) pairs."""
    from ..nodes.step_cache import block_groups
    from .headless import boot

    if model not in MODEL_NAMES or not checkpoint_config(model).trained:
        trained = ", ".join(name for name in MODEL_NAMES if checkpoint_config(name).trained)
        raise UserError(f"--model {model}: bench quality reads the scenes a reference model draws; choose one of {trained}")
    host = boot(comfyui)
    base, clip, vae = load_checkpoint(checkpoint_path(model, Path(models) if models is not None else Path(host.path) / "models"))
    pairs = evaluation_set(images)
    on_cpu = base.load_device.type == "cpu"
    available = _rung_models(host, base, bool(block_groups(base)), on_cpu)
    names = rungs or list(available)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise UserError(f"--rungs {' '.join(unknown)}: not offered here; choose from {', '.join(available)}")
    if STOCK in names:
        names.remove(STOCK)
    names.insert(0, STOCK)

    def sample(model, steps: int, counted: bool):
        # The rung's own diffusion model: a node that runs a private copy (Precision) has modules of its own.
        counter = ModelCallCounter(model.model.diffusion_model) if counted else None
        start = time.perf_counter()
        with counter or contextlib.nullcontext():
            result = sample_images(model, clip, vae, pairs, replace(sampling, steps=steps))
        # No call seen: the rung ran modules no hook was on (a copy made at load time), so it is not counted.
        return result, time.perf_counter() - start, counter.calls if counter is not None and counter.calls else None

    rows: list[QualityRow] = []
    reference = stock_seconds = None
    for name in progress_bar(names, desc="bench quality", unit="rungs"):
        model, node_text = available[name]
        result, seconds, calls = sample(model, sampling.steps, counted=name != "compile")
        row = _row(name, node_text, pairs, result, seconds, calls, reference, stock_seconds, lossless=name in LOSSLESS)
        if name == STOCK:
            reference, stock_seconds = result, row.seconds_per_image
        rows.append(row)

    # The fewer-steps baseline of every rung that saves model calls: stock at the steps that cost as many.
    stock_calls = rows[0].model_calls_per_image or sampling.steps
    baselines: dict[int, list[str]] = {}
    for row in rows[1:]:
        if row.model_calls_per_image is not None and not row.lossless and row.model_calls_per_image < stock_calls - 0.5:
            steps = max(1, round(row.model_calls_per_image / stock_calls * sampling.steps))
            baselines.setdefault(steps, []).append(row.rung)
    for steps, matched in sorted(baselines.items()):
        result, seconds, calls = sample(base, steps, counted=True)
        rows.append(_row(f"stock, {steps} steps", f"— (KSampler steps {steps})", pairs, result, seconds, calls, reference,
                         stock_seconds, baseline_of=", ".join(matched)))
    return rows


def quality_table(rows: list[QualityRow]) -> str:
    """The rows as a Markdown table."""
    header = ("| rung | nodes | s/image | speed | model calls/image | shape+colour | all attributes | PSNR dB | SSIM | note |\n"
              "|---|---|--:|--:|--:|--:|--:|--:|--:|---|")
    lines = [header]
    stock = rows[0]
    for row in rows:
        note = row.note
        if row.lossless and (row.shape_colour, row.all_attributes) != (stock.shape_colour, stock.all_attributes):
            note = (note + "; " if note else "") + "accuracy differs from stock's"
        if row.baseline_of:
            note = (note + "; " if note else "") + f"fewer-steps baseline of {row.baseline_of}"
        calls = "—" if row.model_calls_per_image is None else f"{row.model_calls_per_image:.1f}"
        psnr = "—" if row.psnr_db is None else f"{row.psnr_db:.1f}"
        ssim = "—" if row.ssim is None else f"{row.ssim:.3f}"
        lines.append(f"| {row.rung} | {row.nodes} | {row.seconds_per_image:.2f} | {row.speed_vs_stock:.2f}x | {calls} | "
                     f"{row.shape_colour:.0%} | {row.all_attributes:.0%} | {psnr} | {ssim} | {note} |")
    return "\n".join(lines)
