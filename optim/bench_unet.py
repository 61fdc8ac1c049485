"""UNet latency by precision: one SD1.5-architecture UNet, timed per dtype in one run.

``bench_unet`` builds a diffusers ``UNet2DConditionModel`` with the shapes of a generated
checkpoint size (``mini`` or ``full``; random weights, seeded), converts a copy to each
requested dtype with ``optim.precision``, and times a batched forward (the cond+uncond
batch a sampler step makes). Every dtype is compared with the fp32 output, and its
latency is reported as a ratio to fp32 measured in the same run.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..errors import UserError
from .bench import parse_device
from .modelgen import diffusers_unet_config
from .precision import COMPUTE_DTYPES, PrecisionConfig, apply_precision_, check_compute_dtype, parse_dtype
from .profiler import PeakMemory, Timeline

SEED = 0
UNET_SIZES = ("tiny", "mini", "full")
REFERENCE_DTYPE = "fp32"


@dataclass(frozen=True)
class UNetBenchRow:
    size: str
    dtype: str
    resolution: int
    batch: int
    device: str
    first_s: float
    mean_s: float
    peak_memory_bytes: int
    memory_kind: str
    rel_error_vs_fp32: float
    latency_vs_fp32: float

    def to_dict(self) -> dict:
        return asdict(self)


def _unet(size: str):
    from diffusers import UNet2DConditionModel

    if size not in UNET_SIZES:
        raise UserError(f"--size must be one of {', '.join(UNET_SIZES)}, not {size!r}")
    torch.manual_seed(SEED)
    return UNet2DConditionModel(**diffusers_unet_config(size)).eval()


def _inputs(unet, resolution: int, batch: int, device: torch.device, dtype: torch.dtype):
    factor = 2 ** (len(unet.config.block_out_channels) - 1)
    latent = resolution // 8
    if resolution % 8 or latent % factor:
        raise UserError(f"--resolution must be a multiple of {8 * factor} for this UNet, not {resolution}")
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(batch, unet.config.in_channels, latent, latent, generator=generator)
    context = torch.randn(batch, 77, unet.config.cross_attention_dim, generator=generator)
    timestep = torch.full((batch,), 500.0)
    return x.to(device, dtype), timestep.to(device), context.to(device, dtype)


@torch.inference_mode()
def _time(unet, inputs, repeats: int, device: torch.device):
    memory = PeakMemory(device)
    memory.reset()
    timeline = Timeline(device)
    timeline.mark()
    out = unet(*inputs).sample
    for _ in range(repeats):
        timeline.mark()
        out = unet(*inputs).sample
    timeline.mark()
    seconds = timeline.intervals()
    return out.float(), seconds[0], sum(seconds[1:]) / repeats, memory.read()


def bench_unet(
    size: str = "mini",
    dtypes: list[str] = ("fp32", "fp16"),
    resolution: int = 512,
    batch: int = 2,
    device: str = "cpu",
    repeats: int = 3,
    progress: bool = True,
) -> list[UNetBenchRow]:
    """One row per dtype; fp32 always runs first, as the reference for error and latency."""
    torch_device = parse_device(device)
    if repeats < 1 or batch < 1:
        raise UserError("--repeats and --batch must be >= 1")
    order = [REFERENCE_DTYPE] + [d for d in dtypes if d != REFERENCE_DTYPE]
    for name in order:
        check_compute_dtype(parse_dtype(name, "--dtypes", COMPUTE_DTYPES), torch_device, "--dtypes")
    base = _unet(size)
    rows, reference = [], None
    for name in tqdm(order, desc=f"unet {size} {resolution}px", unit="dtype", disable=not progress):
        unet = copy.deepcopy(base)
        apply_precision_(unet, PrecisionConfig(weight_dtype=name, compute_dtype=name), torch_device)
        unet.to(torch_device)
        out, first, mean, reading = _time(unet, _inputs(unet, resolution, batch, torch_device, unet.dtype), repeats, torch_device)
        del unet
        if reference is None:
            reference = (out, mean)
        rows.append(
            UNetBenchRow(
                size=size,
                dtype=name,
                resolution=resolution,
                batch=batch,
                device=str(torch_device),
                first_s=first,
                mean_s=mean,
                peak_memory_bytes=reading.peak_bytes,
                memory_kind=reading.kind,
                rel_error_vs_fp32=float((out - reference[0]).norm() / reference[0].norm()),
                latency_vs_fp32=mean / reference[1],
            )
        )
    return rows


def unet_table(rows: list[UNetBenchRow]) -> str:
    lines = [
        "| size | dtype | resolution | batch | device | first call s | mean s | latency vs fp32 | peak MiB | rel. error vs fp32 |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "VRAM" if r.memory_kind == "vram_allocated" else "RAM"
        lines.append(
            f"| {r.size} | {r.dtype} | {r.resolution} | {r.batch} | {r.device} | {r.first_s:.3f} | {r.mean_s:.3f} | "
            f"{r.latency_vs_fp32:.2f}x | {r.peak_memory_bytes / 2**20:,.0f} {kind} | {r.rel_error_vs_fp32:.1e} |"
        )
    return "\n".join(lines)
