"""``python -m sdopt bench unet``: UNet latency, memory and error per weight dtype, through the node.

Runs inside ComfyUI (booted headless, like ``sdopt run``): each row is the model that
``SDOptPrecision`` returns for one ``weight_dtype``, loaded by ComfyUI's model management and
called through ComfyUI's own ``apply_model``, so the bench measures exactly the path the node
sets up. The fp32 row is the reference for latency and error, measured in the same process. With
``low_memory_mb``, one more row runs the fp32 model through ``SDOptLowMemory`` at that budget.

The inputs have the shapes the model's family gives its diffusion model (``families/``): the
latent, the text context and, where the family has one (SDXL's ``y``), the vector input. The first
call of each row is timed apart; the others are the steady calls, and their peak is read after the
first has run, beside the memory allocated before them (on a CPU the RSS, with glibc's free heap
handed back first): the difference is the row's working peak, what one call adds to the weights
and inputs.
"""
from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..families import MODEL_NAMES, family_of_config_class, model_name_of_file, resolve_model
from ..measure.profiler import MEMORY_LABELS, PeakMemory, Timeline, format_mib, proc_status_bytes
from ..measure.report import markdown_table
from ..optim.heap_trim import trim_heap
from .modelgen import ensure_checkpoint, text_encoder_path
from .progress import progress_bar

SEED = 0
REFERENCE = "fp32"
NODE = "SDOptPrecision"
LOW_MEMORY_NODE = "SDOptLowMemory"


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
    working_peak_bytes: int | None = None  # the steady calls' peak over what was allocated before them
    working_peak_vs_fp32: float | None = None
    low_memory_mb: int = 0  # the SDOptLowMemory budget this row ran under; 0: not through it
    memory_mode: str | None = None  # Report.memory_mode of the process: dynamic VRAM, classic memory, None (no dynamic VRAM here)

    def to_dict(self) -> dict:
        return asdict(self)


def checkpoint_path(model: str, models: Path) -> Path:
    """The checkpoint for ``--model``: a generated model (``mini``, ``sdxl-mini``: written into
    ``models/checkpoints`` once, Flux's text encoder into ``models/text_encoders``) or a checkpoint file."""
    if model in MODEL_NAMES:
        family, size = resolve_model(model)
        return ensure_checkpoint(model, models / "checkpoints" / family.checkpoint_filename(size), progress=True)
    path = Path(model)
    if not path.is_file():
        raise UserError(f"--model {model!r} is neither one of {', '.join(MODEL_NAMES)} nor a checkpoint file")
    return path


def load_checkpoint(path: Path) -> tuple:
    """(model, clip, vae) of a checkpoint through ComfyUI's own loaders. A generated model whose
    family keeps its text encoder apart (Flux) gets it from its file beside the checkpoint, loaded
    as ComfyUI's CLIPLoader loads it."""
    import comfy.sd

    model, clip, vae, *_ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True)
    name = model_name_of_file(Path(path).name)
    if clip is None and name is not None:
        family, size = resolve_model(name)
        if family.text_encoder_filename(size):
            text_encoder = text_encoder_path(path)
            if not text_encoder.is_file():
                raise UserError(f"{name}'s text encoder {str(text_encoder)!r} is missing: write both files with "
                                f"`python -m sdopt make-model {name} --out {path}`")
            clip_type = getattr(comfy.sd.CLIPType, family.clip_type.upper())
            clip = comfy.sd.load_clip(ckpt_paths=[str(text_encoder)], clip_type=clip_type)
    return model, clip, vae


PROMPT_TOKENS = 77


def unet_inputs(model, resolution: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(latent, sigma, the other inputs of ``apply_model``) for the model of a ComfyUI ModelPatcher:
    the latent's channels from its latent format, the text context and vector widths from its UNet
    config, the vector's name from its family's call (none for a family sdopt does not describe)."""
    base = model.model
    unet_config = base.model_config.unet_config
    family = family_of_config_class(type(base.model_config))
    generator = torch.Generator().manual_seed(SEED)
    latent = resolution // 8
    x = torch.randn(batch, base.latent_format.latent_channels, latent, latent, generator=generator)
    conds = {"c_crossattn": torch.randn(batch, PROMPT_TOKENS, unet_config["context_dim"], generator=generator)}
    if family is not None and family.call.vector and unet_config.get("adm_in_channels"):
        conds[family.call.vector] = torch.randn(batch, unet_config["adm_in_channels"], generator=generator)
    return x, torch.full((batch,), 5.0), conds


def _allocated(device: torch.device) -> int | None:
    """What is allocated now: VRAM through PyTorch on CUDA, else the process RSS with glibc's free
    heap handed back first (so that it counts what is live); None where there is no /proc to read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    gc.collect()
    trim_heap()
    try:
        return proc_status_bytes("VmRSS")
    except OSError:
        return None


@torch.inference_mode()
def _measure(patcher, inputs, repeats: int):
    """(output, first call s, median steady call s, steady peak reading, working peak bytes)."""
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    device = patcher.load_device
    x, sigma, conds = inputs
    x, sigma, conds = x.to(device), sigma.to(device), {k: v.to(device) for k, v in conds.items()}
    # What the sampler hands every call: the nodes' wrappers and attention override live in it.
    conds["transformer_options"] = dict(patcher.model_options.get("transformer_options", {}))
    timeline = Timeline(device)
    timeline.mark()
    patcher.model.apply_model(x, sigma, **conds)
    timeline.mark()
    before = _allocated(device)
    memory = PeakMemory(device)
    memory.reset()
    for _ in range(repeats):
        out = patcher.model.apply_model(x, sigma, **conds)
        timeline.mark()
    reading = memory.read()
    seconds = timeline.intervals()
    working = None if before is None else reading.peak_bytes - before
    return out.float().cpu(), seconds[0], statistics.median(seconds[1:]), reading, working


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
    low_memory_mb: int = 0,
) -> list[UNetBenchRow]:
    """One row per weight dtype, fp32 first as the reference, each through ``SDOptPrecision``; with
    ``low_memory_mb``, then the fp32 model through ``SDOptLowMemory`` at that budget."""
    from .headless import boot

    if repeats < 1 or batch < 1:
        raise UserError("--repeats and --batch must be >= 1")
    if resolution < 64 or resolution % 64:
        raise UserError(f"--resolution must be a positive multiple of 64, not {resolution}")
    if low_memory_mb < 0:
        raise UserError(f"--low-memory must be a budget in MiB, or 0 for no low-memory row, not {low_memory_mb}")
    host = boot(comfyui, vram_cap)
    models = Path(models) if models is not None else Path(host.path) / "models"
    path = checkpoint_path(model, models)
    import comfy.model_management as mm
    import comfy.sd

    base = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]
    node = host.node_classes[NODE]()
    patching = host.pack("nodes.patching")
    inputs = unet_inputs(base, resolution, batch)
    rows, reference = [], None
    order = [(name, 0) for name in [REFERENCE] + [d for d in weight_dtypes if d != REFERENCE]]
    order += [(REFERENCE, low_memory_mb)] if low_memory_mb else []
    for name, budget in progress_bar(order, desc=f"unet {path.stem} {resolution}px", unit="row", disable=not progress):
        patched = node.patch(base, weight_dtype=name, compute_dtype="default", tf32=False, channels_last=False)[0]
        (record,) = [r for r in patching.model_records(patched.model_options) if r["node"] == NODE]
        active = record["active"]
        if budget:
            patched = host.node_classes[LOW_MEMORY_NODE]().patch(patched, budget, True, True)[0]
            (low_memory,) = [r for r in patching.model_records(patched.model_options) if r["node"] == LOW_MEMORY_NODE]
            active = f"{active}; {low_memory['active']}"
        out, first, median, reading, working = _measure(patched, inputs, repeats)
        mm.unload_all_models()
        del patched
        reference = reference or (out, median, working)
        rows.append(UNetBenchRow(
            model=path.stem, weight_dtype=name, active=active, resolution=resolution, batch=batch,
            device=str(base.load_device), first_s=first, median_s=median, peak_memory_bytes=reading.peak_bytes,
            memory_kind=reading.kind, rel_error_vs_fp32=float((out - reference[0]).norm() / reference[0].norm()),
            latency_vs_fp32=median / reference[1], vram_cap_bytes=host.vram_cap_bytes,
            working_peak_bytes=working, working_peak_vs_fp32=_ratio(working, reference[2]), low_memory_mb=budget,
            memory_mode=host.memory_mode.label,
        ))
    return rows


def _ratio(value: int | None, reference: int | None) -> float | None:
    return value / reference if value is not None and reference else None


def unet_table(rows: list[UNetBenchRow]) -> str:
    headers = ["model", "weight_dtype", "low memory", "active", "resolution", "batch", "device", "first call s", "median s",
               "latency vs fp32", "peak MiB", "working peak MiB", "working peak vs fp32", "rel. error vs fp32"]
    body = [
        [r.model, r.weight_dtype, f"{r.low_memory_mb} MiB" if r.low_memory_mb else "—", r.active, r.resolution, r.batch,
         r.device, f"{r.first_s:.3f}", f"{r.median_s:.3f}", f"{r.latency_vs_fp32:.2f}x",
         f"{format_mib(r.peak_memory_bytes)} {MEMORY_LABELS[r.memory_kind]}", format_mib(r.working_peak_bytes),
         "-" if r.working_peak_vs_fp32 is None else f"{r.working_peak_vs_fp32:.2f}", f"{r.rel_error_vs_fp32:.1e}"]
        for r in rows
    ]
    return "\n".join(markdown_table(headers, body, right={4, 5, 7, 8, 9, 10, 11, 12, 13}) + memory_mode_lines(rows))


def memory_mode_lines(rows) -> list[str]:
    """A table's closing line naming ComfyUI's memory management its rows ran under; none where no row knows it."""
    modes = sorted({row.memory_mode for row in rows if row.memory_mode})
    return ["", f"ComfyUI's memory management: {', '.join(modes)} (--memory-mode)."] if modes else []
