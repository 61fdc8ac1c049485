"""``python -m sdopt bench vae``: untiled against tiled VAE decode, each in a fresh process.

For every size a seeded random latent is decoded by the VAE of ``--model`` (a generated model's
name, ``full`` or ``sdxl-mini``): diffusers' ``AutoencoderKL`` of that model's VAE config, holding
the weights ``make-model`` writes into its checkpoint (the same seed, fp16-rounded as in the file;
the SDXL VAE's activations pass fp16's range as the real one's do). It decodes once untiled, then
through ``optim.tiled_vae`` once per requested ``keep_intermediates`` setting (recomputed: least
memory; kept: faster), with the architecture's adapter (``Family.vae_layout``). Each decode runs in
a new Python process, so its peak RSS (VmHWM from /proc/self/status) belongs to that decode alone.
The parent compares the two images: PSNR of the tiled image against the untiled one, both mapped to
[0, 1] as ComfyUI does ((x + 1) / 2), without the clamp, so saturated pixels still count.
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..families import MODEL_NAMES, checkpoint_config, resolve_model
from ..measure.profiler import format_mib, peak_rss_growth
from ..measure.report import markdown_table
from ..optim.heap_trim import trim_heap
from .fresh_process import run_in_fresh_process, serve_child
from .modelgen import diffusers_vae_config, generate_tensor, vae_ldm_specs
from .progress import progress_bar

SEED = 0
UNTILED = "untiled"
TILED = "tiled"
KEEP = {"no": False, "yes": True, "auto": None}  # --keep-intermediates choices
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class VAEBenchRow:
    """One decode of a ``size`` x ``size`` image in a fresh process."""

    size: int
    mode: str
    model: str
    device: str
    seconds: float
    peak_rss_bytes: int  # the process's VmHWM during the decode: interpreter, libraries, weights and the decode
    decode_rss_bytes: int  # that peak minus the RSS just before the decode: the decode's own growth
    tile: int | None = None
    tiles: int | None = None
    passes: int | None = None
    kept_intermediates: bool | None = None
    oom_retries: int | None = None
    stored: int | None = None  # tile values kept between passes in the fp16 store...
    stored_wide: int | None = None  # ...of which these passed fp16's range and were kept in fp32
    psnr_vs_untiled_db: float | None = None
    peak_vs_untiled: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def build_vae(model: str = "full", overrides: dict | None = None, seed: int = SEED):
    """The diffusers ``AutoencoderKL`` of model ``model``'s VAE with the weights of its generated
    checkpoint (``make-model model --seed seed``, fp16), converted from the checkpoint's LDM keys by
    diffusers. With ``overrides`` (a narrower config, for tests) the weights are seeded random ones."""
    try:
        from diffusers import AutoencoderKL
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    except ImportError:
        raise UserError("bench vae builds the VAE with diffusers: pip install diffusers (or sdopt[diffusers])") from None
    torch.manual_seed(seed)
    vae = AutoencoderKL(**{**diffusers_vae_config(model), **(overrides or {})}).eval()
    if not overrides:
        cfg = checkpoint_config(model)
        specs = vae_ldm_specs(cfg.vae)
        ldm = {key: generate_tensor(cfg.vae_prefix + key, spec, seed, torch.float16).float() for key, spec in specs.items()}
        vae.load_state_dict(convert_ldm_vae_checkpoint(ldm, vae.config))
    return vae


def _latent(size: int, downscale: int, channels: int, seed: int) -> torch.Tensor:
    return torch.randn(1, channels, size // downscale, size // downscale, generator=torch.Generator().manual_seed(seed))


def decode_once(spec: dict) -> dict:
    """One decode as ``spec`` says (run in the child process): timing, memory, tiling stats."""
    from ..optim.tiled_vae import TiledVAEConfig, tiled_decode
    from ..optim.precision import DTYPES

    vae = build_vae(spec["model"], spec.get("overrides"), spec["seed"])
    architecture = resolve_model(spec["model"])[0].vae_layout
    trim_heap()  # the conversion's freed copies must not be RSS that the decode then reuses unseen
    downscale = 2 ** (len(vae.config.block_out_channels) - 1)
    z = _latent(spec["size"], downscale, vae.config.latent_channels, spec["seed"])
    with torch.inference_mode():  # one-time library set-up (oneDNN, thread pools) is not the decode's
        vae.decode(_latent(8 * downscale, downscale, vae.config.latent_channels, spec["seed"]))

    @torch.inference_mode()
    def decode():
        if spec["tiled"]:
            config = TiledVAEConfig(tile=spec["tile"], overlap=spec["overlap"], keep_intermediates=spec.get("keep"),
                                    store_dtype=DTYPES[spec["store_dtype"]] if spec.get("store_dtype") else None,
                                    budget_bytes=spec.get("budget_bytes"))
            result = tiled_decode(vae, z, config, architecture=architecture)
            return result.output, result.stats
        return vae.decode(z).sample, None

    started = time.perf_counter()
    (image, stats), peak, growth = peak_rss_growth(decode)
    seconds = time.perf_counter() - started
    torch.save(image, spec["out"])
    report = {"seconds": seconds, "peak_rss_bytes": peak, "decode_rss_bytes": growth}
    if stats is not None:
        report.update(tile=stats.tile, tiles=stats.tiles, passes=stats.passes, kept_intermediates=stats.kept_intermediates,
                      oom_retries=stats.oom_retries, stored=stats.stored, stored_wide=stats.stored_wide)
    return report


def _run_child(spec: dict) -> dict:
    return run_in_fresh_process(__spec__.name, spec, f"the {'tiled' if spec['tiled'] else 'untiled'} {spec['size']} px decode")


def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of two decoder outputs in [-1, 1], as [0, 1] images without clamping (peak 1)."""
    mse = ((image.double() - reference.double()) / 2).square().mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def image_psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB of two decoded images in [0, 1] (VAEDecode's output)."""
    return psnr(image * 2 - 1, reference * 2 - 1)


def bench_vae(
    sizes: list[int],
    tile: int = 512,
    overlap: int = 0,
    keep_intermediates: list[str] = ("no", "yes"),
    model: str = "full",
    store_dtype: str | None = "fp16",
    budget_mb: int | None = None,
    seed: int = SEED,
    overrides: dict | None = None,
    progress: bool = True,
) -> list[VAEBenchRow]:
    """For each size an untiled decode, then one tiled decode per ``keep_intermediates`` setting
    (``no``, ``yes``, ``auto``), each in a fresh process; rows in that order. ``auto`` decides by a
    budget of ``budget_mb`` MiB, or of the free RAM where it is None (the CLI's ``--budget-mb 0``)."""
    from ..optim.tiled_vae import check_tile_inputs

    if not _PROC_CLEAR_REFS.exists():
        raise UserError("bench vae reads and resets the peak RSS through /proc/self: it needs Linux")
    if model not in MODEL_NAMES:
        raise UserError(f"--model {model!r}: choose one of {', '.join(MODEL_NAMES)}")
    problem = check_tile_inputs(tile, overlap)
    if problem:
        raise UserError(f"--{problem}")
    unknown = [k for k in keep_intermediates if k not in KEEP]
    if unknown:
        raise UserError(f"--keep-intermediates {unknown[0]!r}: choose from {', '.join(KEEP)}")
    for size in sizes:
        if size < 64 or size % 64:
            raise UserError(f"--sizes: {size} px must be a multiple of 64")
    if budget_mb is not None and budget_mb <= 0:
        raise UserError(f"--budget-mb must be a positive number of MiB, not {budget_mb} (0, or none given, is the free RAM)")
    rows = []
    runs = [(size, keep) for size in sizes for keep in (None, *keep_intermediates)]
    with tempfile.TemporaryDirectory(prefix="sdopt-bench-vae-") as folder:
        bar = progress_bar(runs, desc="vae decode", unit="run", disable=not progress)
        for size, keep in bar:
            name = UNTILED if keep is None else f"{TILED}-keep-{keep}"
            bar.set_postfix_str(f"{size} px {name}")
            out = Path(folder) / f"{size}-{name}.pt"
            spec = {"size": size, "tiled": keep is not None, "tile": tile, "overlap": overlap, "model": model,
                    "seed": seed, "overrides": overrides, "keep": KEEP.get(keep), "store_dtype": store_dtype,
                    "out": str(out), "budget_bytes": budget_mb * 2**20 if budget_mb else None}
            row = VAEBenchRow(size=size, mode=TILED if keep is not None else UNTILED, model=model, device="cpu",
                              **_run_child(spec))
            if keep is None:
                untiled, reference = row, torch.load(out)
            else:
                row = VAEBenchRow(**{**row.to_dict(), "psnr_vs_untiled_db": psnr(torch.load(out), reference),
                                     "peak_vs_untiled": row.peak_rss_bytes / untiled.peak_rss_bytes})
            out.unlink()
            rows.append(row)
    return rows


def vae_table(rows: list[VAEBenchRow]) -> str:
    headers = ["size", "mode", "tile", "tiles", "passes", "intermediates", "stored past fp16", "seconds", "peak RSS MiB",
               "decode growth MiB", "peak vs untiled", "PSNR vs untiled dB"]
    body = [
        [f"{r.size}x{r.size}", r.mode, r.tile or "—", r.tiles or "—", r.passes or "—",
         "—" if r.kept_intermediates is None else ("kept" if r.kept_intermediates else "recomputed"),
         "—" if not r.stored else f"{r.stored_wide} of {r.stored}",
         f"{r.seconds:.1f}", format_mib(r.peak_rss_bytes), format_mib(r.decode_rss_bytes),
         "—" if r.peak_vs_untiled is None else f"{r.peak_vs_untiled:.0%}",
         "—" if r.psnr_vs_untiled_db is None else f"{r.psnr_vs_untiled_db:.1f}"]
        for r in rows
    ]
    return "\n".join(markdown_table(headers, body, right={2, 3, 4, 7, 8, 9, 10, 11}))


if __name__ == "__main__":
    serve_child(decode_once)
