"""``python -m sdopt bench unet``: UNet latency, memory and error per weight dtype, through the node.

Runs inside ComfyUI (booted headless, like ``sdopt run``): each row is the model that
``SDOptPrecision`` returns for one ``weight_dtype``, loaded by ComfyUI's model management and
called through ComfyUI's own ``apply_model``, so the bench measures exactly the path the node
sets up. The fp32 row is the reference for latency and error, measured in the same process.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..measure.profiler import MEMORY_LABELS, PeakMemory, Timeline, format_mib
from ..measure.report import markdown_table
from .modelgen import SIZES, write_checkpoint

SEED = 0
REFERENCE = "fp32"
NODE = "SDOptPrecision"


@dataclass(frozen=True)
class UNetBenchRow:
    model: str
    weight_dtype: str
    active: str
    resolution: int
    batch: int
    device: str
    first_s: float
    median_s: float
    peak_memory_bytes: int
    memory_kind: str
    rel_error_vs_fp32: float
    latency_vs_fp32: float
    vram_cap_bytes: int | None = None  # --vram-cap in force

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoint_path(model: str, models: Path) -> Path:
    """The checkpoint for ``--model``: a generated size (written into ``models/checkpoints`` once) or a file."""
    if model in SIZES:
        path = models / "checkpoints" / f"sdopt-{model}-sd15.safetensors"
        if not path.exists():
            write_checkpoint(model, path, seed=0, dtype="fp16", progress=True)
        return path
    path = Path(model)
    if not path.is_file():
        raise UserError(f"--model {model!r} is neither one of {', '.join(SIZES)} nor a checkpoint file")
    return path


def _inputs(resolution: int, batch: int):
    generator = torch.Generator().manual_seed(SEED)
    latent = resolution // 8
    x = torch.randn(batch, 4, latent, latent, generator=generator)
    context = torch.randn(batch, 77, 768, generator=generator)
    sigma = torch.full((batch,), 5.0)
    return x, sigma, context


@torch.inference_mode()
def _measure(patcher, inputs, repeats: int):
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    device = patcher.load_device
    x, sigma, context = (t.to(device) for t in inputs)
    memory = PeakMemory(device)
    memory.reset()
    timeline = Timeline(device)
    timeline.mark()
    for _ in range(repeats + 1):
        out = patcher.model.apply_model(x, sigma, c_crossattn=context)
        timeline.mark()
    seconds = timeline.intervals()
    return out.float().cpu(), seconds[0], statistics.median(seconds[1:]), memory.read()


def bench_unet(
    comfyui: Path,
    model: str = "mini",
    weight_dtypes: list[str] = ("auto", "fp16", "bf16"),
    resolution: int = 512,
    batch: int = 2,
    repeats: int = 3,
    models: Path | None = None,
    progress: bool = True,
    vram_cap: int | None = None,
) -> list[UNetBenchRow]:
    """One row per weight dtype, fp32 first as the reference, each through ``SDOptPrecision``."""
    from .headless import boot

    if repeats < 1 or batch < 1:
        raise UserError("--repeats and --batch must be >= 1")
    if resolution % 64:
        raise UserError(f"--resolution must be a multiple of 64, not {resolution}")
    host = boot(comfyui, vram_cap)
    models = Path(models) if models is not None else Path(host.path) / "models"
    path = checkpoint_path(model, models)
    import comfy.model_management as mm
    import comfy.sd

    base = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]
    node = host.node_classes[NODE]()
    glue = host.pack("nodes.glue")
    inputs = _inputs(resolution, batch)
    rows, reference = [], None
    order = [REFERENCE] + [d for d in weight_dtypes if d != REFERENCE]
    for name in tqdm(order, desc=f"unet {path.stem} {resolution}px", unit="dtype", disable=not progress):
        patched = node.patch(base, weight_dtype=name, compute_dtype="default", tf32=False, channels_last=False)[0]
        (record,) = [r for r in glue.model_records(patched.model_options) if r["node"] == NODE]
        out, first, median, reading = _measure(patched, inputs, repeats)
        mm.unload_all_models()
        del patched
        reference = reference or (out, median)
        rows.append(UNetBenchRow(
            model=path.stem, weight_dtype=name, active=record["active"], resolution=resolution, batch=batch,
            device=str(base.load_device), first_s=first, median_s=median, peak_memory_bytes=reading.peak_bytes,
            memory_kind=reading.kind, rel_error_vs_fp32=float((out - reference[0]).norm() / reference[0].norm()),
            latency_vs_fp32=median / reference[1], vram_cap_bytes=host.vram_cap_bytes,
        ))
    return rows


def unet_table(rows: list[UNetBenchRow]) -> str:
    headers = ["model", "weight_dtype", "active", "resolution", "batch", "device", "first call s", "median s",
               "latency vs fp32", "peak MiB", "rel. error vs fp32"]
    body = [
        [r.model, r.weight_dtype, r.active, r.resolution, r.batch, r.device, f"{r.first_s:.3f}", f"{r.median_s:.3f}",
         f"{r.latency_vs_fp32:.2f}x", f"{format_mib(r.peak_memory_bytes)} {MEMORY_LABELS[r.memory_kind]}", f"{r.rel_error_vs_fp32:.1e}"]
        for r in rows
    ]
    return "\n".join(markdown_table(headers, body, right={3, 4, 6, 7, 8, 9, 10}))
