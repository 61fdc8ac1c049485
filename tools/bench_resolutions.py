"""``python -m sdopt bench resolutions``: stock ComfyUI against sdopt's low-memory stack and sdopt Auto, per image size.

One process, one booted ComfyUI, one checkpoint, ComfyUI's own KSampler (``common_ksampler``, as in
``bench speed``). Each cell is one size and one stack:

- **stock**: checkpoint → KSampler → VAEDecode;
- **sdopt**: the same, with the model through SDOptLowMemory (256 MiB) and SDOptOffload (budget,
  1024 MiB of UNet weights in VRAM; a recorded no-op on a CPU) and the VAE through SDOptTiledVAE
  (auto tile, only when the untiled decode would not fit). With ``offload_mb=None`` ("auto"), each
  cell's Offload budget is the planner's: as much of the UNet as the cap leaves beside the step's
  inputs and working peak plus the planner's tolerance, as ``plan`` offers it (sequential where that
  keeps no more than the streamed layers). With ``low_memory="when-needed"``,
  SDOptLowMemory is wired only where the planner predicts that the step does not fit without it:
  Offload and an untiled decode change no number, so such a cell gives stock's uncapped image
  exactly, where Low Memory's sequential CFG and chunked ops run other kernels, which round differently
  in half precision;
- **auto**: the model and the VAE through SDOptAuto (``auto_goal``, its budget what ComfyUI says is free,
  which ``--vram-cap`` bounds): it picks its stack per cell, and its record says which.

Before a cell runs, ``tools.plan``'s planner predicts its peak (UNet step and VAE decode under the
stack's settings, from fake tensors) in the terms the cell's peak is measured in: what is allocated
before it (models unloaded first; on a CPU the process RSS, weights included), plus the weights the
stage loads onto a GPU, its inputs and its working peak. A cell predicted over the budget (the
``--vram-cap``, else the GPU's memory; on a CPU the RSS plus the free RAM) is marked "predicted OOM"
(an auto cell is predicted as the sdopt stack with Low Memory when needed and the planner's Offload:
the least Auto can choose)
and not run; with ``confirm`` it runs anyway on a GPU, never on a CPU, where running out of memory
can take the machine down. A cell that runs records the sampler plus decode time and the peak
memory (VRAM allocated on CUDA, process RSS on a CPU), or "out of memory". The prediction is an
upper bound where ComfyUI adapts on its own: it counts stock's UNet weights fully resident (ComfyUI
loads them partly when VRAM is short) and models stock attention as sdpa (ComfyUI's CPU attention
sizes its slices from free memory).
"""
from __future__ import annotations

import gc
import math
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..measure.profiler import MEMORY_LABELS, PeakMemory, format_mib
from ..measure.report import markdown_table
from ..optim.device import free_memory
from ..optim.heap_trim import trim_heap
from ..optim.offload import OffloadConfig
from ..optim.precision import DTYPES
from .bench_speed import empty_latent, encode_prompts, optimization_notes, profiled_sample, timed_decode
from .bench_unet import checkpoint_path, load_checkpoint
from .bench_vae import image_psnr
from .plan import UNET_SETTINGS, UNET_STEP, VAE_DECODE, VAE_SETTINGS, Planner, architecture, budget_resident_bytes, lowmem_setting
from .progress import progress_bar

STOCK, SDOPT, AUTO = "stock", "sdopt", "auto"
STACKS = (STOCK, SDOPT, AUTO)
OK, OUT_OF_MEMORY, PREDICTED_OOM = "ok", "out of memory", "predicted OOM"
LOWMEM_BUDGET_MB, OFFLOAD_BUDGET_MB = 256, 1024
LOW_MEMORY_ALWAYS, LOW_MEMORY_WHEN_NEEDED = "always", "when-needed"
LOW_MEMORY_CHOICES = (LOW_MEMORY_ALWAYS, LOW_MEMORY_WHEN_NEEDED)


def offload_config(offload_mb: int) -> OffloadConfig:
    """The sdopt stack's Offload settings: a budget of ``offload_mb`` MiB, or with 0 sequential."""
    return OffloadConfig("budget", offload_mb * _MiB) if offload_mb else OffloadConfig("sequential", 0)


def stack_chains(offload_mb: int | None, low_memory: str = LOW_MEMORY_ALWAYS, auto_goal: str = "fastest") -> dict[str, str]:
    """What each stack wires; ``offload_mb`` 0 streams the whole UNet (Offload's sequential mode),
    None takes the planner's budget per cell."""
    offload = "budget_mb from the planner per size, or sequential" if offload_mb is None else offload_config(offload_mb).describe()
    lowmem = f"LowMemory({LOWMEM_BUDGET_MB} MiB)"
    if low_memory == LOW_MEMORY_WHEN_NEEDED:
        lowmem += " where the step is predicted not to fit without it"
    return {
        STOCK: "CheckpointLoader → KSampler → VAEDecode",
        SDOPT: f"{lowmem} → Offload({offload}) → KSampler → TiledVAE(auto) → VAEDecode",
        AUTO: f"Auto(goal {auto_goal}) on the model and the VAE → KSampler → VAEDecode",
    }
_MiB = 2**20


@dataclass(frozen=True)
class ResolutionRow:
    """One cell: ``size`` x ``size`` pixels through one stack. Times and peaks are None where it did not run."""

    size: int
    stack: str
    status: str
    predicted_peak_bytes: int
    budget_bytes: int
    predicted_settings: str
    model: str
    steps: int
    device: str
    memory_kind: str
    seconds: float | None = None  # sampler + decode
    sampler_s: float | None = None
    decode_s: float | None = None
    peak_memory_bytes: int | None = None
    psnr_vs_stock_db: float | None = None  # the decoded image against stock's at this size
    psnr_vs_uncapped_db: float | None = None  # against stock's with the cap lifted (--against-uncapped)
    vram_cap_bytes: int | None = None  # --vram-cap in force
    offload_mb: int | None = OFFLOAD_BUDGET_MB  # the sdopt stack's Offload budget; 0: sequential; None: the planner's per cell
    low_memory: str = LOW_MEMORY_ALWAYS  # whether the sdopt stack wires Low Memory always or when needed
    notes: str = ""
    memory_mode: str | None = None  # Report.memory_mode of the process (dynamic VRAM maps weights past --vram-cap)
    auto_goal: str = "fastest"  # the auto stack's goal

    @property
    def predicted_fits(self) -> bool:
        return self.predicted_peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def should_run(predicted_peak_bytes: int, budget_bytes: int, confirm: bool, on_gpu: bool) -> bool:
    """A cell runs when it is predicted to fit; one predicted not to only with ``confirm`` on a GPU,
    where out of memory is an exception, not the kernel's OOM killer."""
    return predicted_peak_bytes <= budget_bytes or (confirm and on_gpu)


@dataclass(frozen=True)
class CellPlan:
    """What the planner predicts for one cell and what the cell then wires."""

    peak_bytes: int
    settings: str  # the UNet step's and the VAE decode's settings it assumed
    low_memory: bool = False  # the sdopt step runs through SDOptLowMemory
    offload_mb: int = 0  # the sdopt stack's Offload budget at this size; 0: sequential


def predict_cell(planner, stack: str, size: int, allocated_bytes: int, budget_bytes: int,
                 weights_on_device: bool, offload_mb: int | None = OFFLOAD_BUDGET_MB,
                 low_memory: str = LOW_MEMORY_ALWAYS) -> CellPlan:
    """One cell's predicted peak: the larger of the UNet step and the VAE decode, each the
    ``allocated_bytes`` already there plus the weights it loads (when ``weights_on_device``: a GPU),
    its inputs and its working peak. The tiled VAE takes the first setting that fits, as its auto
    tile does; with ``low_memory`` when-needed, so does the sdopt step (plain first, then Low Memory).
    ``offload_mb`` None: the sdopt step keeps the UNet weights the planner's budget leaves for that
    step's setting (``plan``'s budget offload), sequential where that is no more than the streamed layers.
    An auto cell is predicted as the least Auto can choose: sdopt's with both of those."""
    if stack == AUTO:
        stack, offload_mb, low_memory = SDOPT, None, LOW_MEMORY_WHEN_NEEDED
    lowmem = lowmem_setting(LOWMEM_BUDGET_MB)
    if stack == STOCK:
        unet_settings, vae_settings = UNET_SETTINGS[:1], VAE_SETTINGS[:1]
    else:
        unet_settings = (UNET_SETTINGS[0], lowmem) if low_memory == LOW_MEMORY_WHEN_NEEDED else (lowmem,)
        vae_settings = VAE_SETTINGS

    def unet_weights(step) -> tuple[int, int]:
        """(the UNet weight bytes on the device during ``step``, the sdopt Offload budget in MiB; 0: sequential)."""
        if stack == STOCK:
            return planner.weights["unet"], 0
        mb = offload_mb
        if mb is None:
            mb = (budget_resident_bytes(planner, step, budget_bytes - allocated_bytes) or 0) // _MiB
        return (min(planner.weights["unet"], mb * _MiB) if mb else planner.streamed_unet_bytes), mb

    def total(step_or_decode, weights_bytes: int) -> int:
        loaded = weights_bytes if weights_on_device else 0
        return allocated_bytes + loaded + step_or_decode.input_bytes + step_or_decode.peak_bytes

    for unet_setting in unet_settings:
        step = planner.predict(UNET_STEP, unet_setting, size, size)
        weights_bytes, cell_offload_mb = unet_weights(step)
        unet_peak = total(step, weights_bytes)
        if unet_peak <= budget_bytes:
            break
    for vae_setting in vae_settings:
        vae_peak = total(planner.predict(VAE_DECODE, vae_setting, size, size), planner.weights["vae"])
        if vae_peak <= budget_bytes:
            break
    settings = f"{unet_setting.name}; VAE {vae_setting.name}"
    if stack == SDOPT:
        settings += f"; Offload {offload_config(cell_offload_mb).describe()}"
    return CellPlan(max(unet_peak, vae_peak), settings, unet_setting is lowmem, cell_offload_mb)


def _sdopt_model(host, model, cell: CellPlan):
    """The model through the sdopt nodes a user would wire for ``cell``."""
    node = host.node_classes
    if cell.low_memory:
        model = node["SDOptLowMemory"]().patch(model, LOWMEM_BUDGET_MB, True, True)[0]
    offload = offload_config(cell.offload_mb)
    return node["SDOptOffload"]().patch(model, offload.mode, offload.budget_bytes // _MiB, "fallback")[0]


def _auto_wired(host, model, vae, goal: str) -> tuple:
    """The model and the VAE through sdopt Auto, as a user would wire it."""
    return tuple(host.node_classes["SDOptAuto"]().apply(model, goal, False, 0, vae=vae))


def _oom_errors(model_management) -> tuple[type[BaseException], ...]:
    comfy_oom = getattr(model_management, "OOM_EXCEPTION", None)
    # ComfyUI falls back to plain Exception where torch has no CUDA OOM type: that would catch every error.
    own = (comfy_oom,) if isinstance(comfy_oom, type) and comfy_oom is not Exception else ()
    return (torch.OutOfMemoryError, *own)


def _release(model_management, memory: PeakMemory) -> int:
    """Unload every model and free cached memory; what stays allocated (VRAM, or the process RSS)."""
    model_management.unload_all_models()
    model_management.soft_empty_cache()
    gc.collect()
    if memory.device.type != "cuda":
        trim_heap()
    memory.reset()
    return memory.read().peak_bytes


def _budget(host, memory: PeakMemory, allocated_bytes: int) -> int:
    if memory.device.type == "cuda":
        return host.vram_cap_bytes or torch.cuda.mem_get_info(memory.device)[1]
    return allocated_bytes + free_memory("cpu")


def _run_cell(host, model, vae, memory: PeakMemory, size: int, conds, steps: int, label: str):
    """(image, sampler s, decode s, peak bytes, notes) of one cell."""
    from comfy_execution.utils import CurrentNodeContext

    latent = empty_latent(model, size)
    prompt_id = f"bench-{uuid.uuid4().hex}"
    with CurrentNodeContext(prompt_id, "1"):  # the tiled VAE files its records under this prompt
        samples, run, _ = profiled_sample(host, model, label, latent, conds, steps)
        image, decode_s = timed_decode(vae, samples)
    # The profiler's run reset the peak when sampling began; this reading covers sampling and decode.
    peak = max(run["peak_memory_bytes"], memory.read().peak_bytes)
    records = run["optimizations"] + host.pack("nodes.prompt_context").prompt_log(prompt_id).records
    return image, run["sampler_total_s"], decode_s, peak, optimization_notes(records)


def _uncapped_image(host, model_management, memory: PeakMemory, stock: tuple, size: int, conds, steps: int):
    """Stock's image at ``size`` with the VRAM cap lifted for this one run, then put back (the next
    cell releases what this run loaded)."""
    requested = host.vram_cap.cap_bytes if host.vram_cap is not None else None
    _release(model_management, memory)
    host.set_vram_cap(None)
    try:
        return _run_cell(host, *stock, memory, size, conds, steps, "stock uncapped")[0]
    finally:
        host.set_vram_cap(requested)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@torch.inference_mode()
def bench_resolutions(*args, **kwargs) -> list[ResolutionRow]:
    """Every row of ``resolution_rows``."""
    return list(resolution_rows(*args, **kwargs))


def resolution_rows(
    comfyui: Path,
    model: str = "mini",
    sizes: list[int] = (512, 1024, 2048),
    steps: int = 4,
    vram_cap: int | None = None,
    confirm: bool = False,
    models: Path | None = None,
    progress: bool = True,
    offload_mb: int | None = OFFLOAD_BUDGET_MB,
    against_uncapped: bool = False,
    low_memory: str = LOW_MEMORY_ALWAYS,
    stacks: tuple[str, ...] = STACKS,
    auto_goal: str = "fastest",
) -> Iterator[ResolutionRow]:
    """Rows per size, one per stack in ``STACKS``' order, each as soon as its cell is done; ``offload_mb``
    is the sdopt stack's Offload budget (0: sequential; None: the planner's per cell). ``against_uncapped``:
    before each size, stock runs once more with the cap lifted, and every stack's image is compared with
    that one too. ``low_memory``: whether the sdopt stack wires Low Memory always or only where the step
    needs it. ``auto_goal``: the auto stack's goal."""
    from ..nodes.stack_choice import GOALS

    from .headless import boot

    if not sizes:
        raise UserError("--sizes: give at least one image side, e.g. 512,1024")
    for size in sizes:
        if size < 64 or size % 64:
            raise UserError(f"--sizes: {size} px must be a positive multiple of 64")
    if steps < 1:
        raise UserError(f"--steps must be >= 1, not {steps}")
    if offload_mb is not None and offload_mb < 0:
        raise UserError(f"--offload-mb must be >= 0 (0 streams the whole UNet), not {offload_mb}")
    if low_memory not in LOW_MEMORY_CHOICES:
        raise UserError(f"--low-memory: {low_memory!r} is not one of {', '.join(LOW_MEMORY_CHOICES)}")
    unknown = [stack for stack in stacks if stack not in STACKS]
    if unknown or not stacks:
        raise UserError(f"--stacks: give some of {', '.join(STACKS)}, not {', '.join(unknown) or 'none'}")
    if auto_goal not in GOALS:
        raise UserError(f"--auto-goal: {auto_goal!r} is not one of {', '.join(GOALS)}")
    stacks = _in_stack_order(stacks)
    host = boot(comfyui, vram_cap)
    import comfy.model_management as mm
    path = checkpoint_path(model, Path(models) if models is not None else Path(host.path) / "models")
    base, clip, vae = load_checkpoint(path)
    dtype_names = {dtype: name for name, dtype in DTYPES.items()}
    on_gpu = base.load_device.type == "cuda"
    planner = Planner(architecture(str(path)), dtype_names.get(base.model.get_dtype(), "fp16"), "cuda" if on_gpu else "cpu")
    conds = {size: encode_prompts(clip, size) for size in sizes}
    tiled = host.node_classes["SDOptTiledVAE"]().apply(vae, 0, 0, True, 0)[0]
    memory = PeakMemory(base.load_device)
    oom_errors = _oom_errors(mm)
    stock_images, uncapped_images, uncapped_failures = {}, {}, {}
    cells = [(size, stack) for size in sizes for stack in stacks]
    bar = progress_bar(cells, desc=f"resolutions {path.stem} {steps} steps", unit="cell", disable=not progress)
    for size, stack in bar:
        bar.set_postfix_str(f"{size} px {stack}")
        if against_uncapped and stack == stacks[0]:
            try:
                uncapped_images[size] = _uncapped_image(host, mm, memory, (base, vae), size, conds[size], steps)
            except oom_errors as error:
                uncapped_failures[size] = f"the uncapped reference ran out of memory: {_first_line(error)}"
        allocated = _release(mm, memory)
        budget = _budget(host, memory, allocated)
        cell = predict_cell(planner, stack, size, allocated, budget, weights_on_device=on_gpu, offload_mb=offload_mb,
                            low_memory=low_memory)
        row = dict(size=size, stack=stack, predicted_peak_bytes=cell.peak_bytes, budget_bytes=budget, predicted_settings=cell.settings,
                   offload_mb=offload_mb, low_memory=low_memory, auto_goal=auto_goal,
                   model=path.stem, steps=steps, device=str(base.load_device), memory_kind=memory.kind,
                   vram_cap_bytes=host.vram_cap_bytes, memory_mode=host.memory_mode.label)
        if not should_run(cell.peak_bytes, budget, confirm, on_gpu):
            why = "" if on_gpu or not confirm else "not confirmed: on a CPU, running out of memory can take the machine down"
            yield ResolutionRow(status=PREDICTED_OOM, notes=why, **row)
            continue
        try:
            wired = {STOCK: lambda: (base, vae), SDOPT: lambda: (_sdopt_model(host, base, cell), tiled),
                     AUTO: lambda: _auto_wired(host, base, vae, auto_goal)}[stack]()
            image, sampler_s, decode_s, peak, notes = _run_cell(host, *wired, memory, size, conds[size], steps, stack)
        except oom_errors as error:
            yield ResolutionRow(status=OUT_OF_MEMORY, notes=_first_line(error), **row)
            continue
        if stack == STOCK:
            stock_images[size] = image
        similarity = image_psnr(image, stock_images[size]) if stack != STOCK and size in stock_images else None
        to_uncapped = image_psnr(image, uncapped_images[size]) if size in uncapped_images else None
        notes = "; ".join(filter(None, [notes, uncapped_failures.get(size, "")]))
        yield ResolutionRow(status=OK, seconds=sampler_s + decode_s, sampler_s=sampler_s, decode_s=decode_s,
                            peak_memory_bytes=peak, psnr_vs_stock_db=similarity, psnr_vs_uncapped_db=to_uncapped, notes=notes, **row)
    _release(mm, memory)


def _cell_text(row: ResolutionRow | None) -> list[str]:
    """[seconds, peak, status, predicted] of one cell for the table."""
    if row is None:
        return ["—"] * 4
    predicted = f"{format_mib(row.predicted_peak_bytes)} {'≤' if row.predicted_fits else '>'} {format_mib(row.budget_bytes)}"
    seconds = "—" if row.seconds is None else f"{row.seconds:.2f}"
    return [seconds, format_mib(row.peak_memory_bytes), row.status, predicted]


def _in_stack_order(names) -> tuple[str, ...]:
    """The stacks named in ``names``, each once, in ``STACKS``' order."""
    named = set(names)
    return tuple(stack for stack in STACKS if stack in named)


def resolutions_table(rows: list[ResolutionRow]) -> str:
    """One line per size, the stacks side by side, then what each wires and what the sdopt nodes did."""
    if not rows:
        return "no cells"
    memory = MEMORY_LABELS[rows[0].memory_kind]
    stacks = _in_stack_order(r.stack for r in rows)
    compared = [stack for stack in stacks if stack != STOCK]
    headers = ["size"]
    for stack in stacks:
        headers += [f"{stack} s", f"{stack} peak MiB {memory}", f"{stack} status", f"{stack} predicted / budget MiB"]
    headers += [f"{stack} PSNR vs stock dB" for stack in compared]
    uncapped = any(r.psnr_vs_uncapped_db is not None for r in rows)
    if uncapped:
        headers.append(f"PSNR vs uncapped stock dB: {' / '.join(stacks)}")
    cells = {(r.size, r.stack): r for r in rows}
    body = []
    for size in dict.fromkeys(r.size for r in rows):
        line = [f"{size}x{size}"]
        for stack in stacks:
            line += _cell_text(cells.get((size, stack)))
        line += [_db(cell and cell.psnr_vs_stock_db) for cell in (cells.get((size, stack)) for stack in compared)]
        if uncapped:
            line.append(" / ".join(_db(cell and cell.psnr_vs_uncapped_db) for cell in (cells.get((size, stack)) for stack in stacks)))
        body.append(line)
    first = rows[0]
    cap = f", VRAM capped at {format_mib(first.vram_cap_bytes)} MiB" if first.vram_cap_bytes else ""
    mode = f" ({first.memory_mode})" if first.memory_mode else ""
    lines = [f"{first.model} on {first.device}{mode}, {first.steps} steps{cap}; time = sampler + VAE decode", ""]
    numeric = {1 + 4 * i + j for i in range(len(stacks)) for j in (0, 1, 3)} | set(range(1 + 4 * len(stacks), len(headers)))
    lines += markdown_table(headers, body, right=numeric)
    chains = stack_chains(first.offload_mb, first.low_memory, first.auto_goal)
    lines += ["", *(f"- **{stack}**: {chains[stack]}" for stack in stacks)]
    for stack in compared:
        ran = [r for r in rows if r.stack == stack and r.status == OK and r.notes]
        # Auto decides per size, so each of its cells says what it chose; sdopt's stack is the same at every size.
        for row in ran if stack == AUTO else ran[:1]:
            lines.append(f"- {stack} at {row.size} px: {row.notes}")
    lines += [f"- {r.stack} at {r.size} px: {r.status}: {r.notes}" for r in rows if r.status != OK and r.notes]
    return "\n".join(lines)


def _db(value: float | None) -> str:
    """A PSNR for the table; identical images are infinitely close."""
    if value is None:
        return "—"
    return "identical" if math.isinf(value) else f"{value:.1f}"


def save_heatmap(rows: list[ResolutionRow], path: Path) -> str | None:
    """A heatmap (a row per stack, columns sizes, colour = seconds, text = seconds and peak;
    cells that did not run hatched and named); None, or why not (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        from matplotlib.patches import Rectangle
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    except ImportError:
        return "no plot: pip install matplotlib"
    import numpy as np

    sizes = list(dict.fromkeys(r.size for r in rows))
    stacks = _in_stack_order(r.stack for r in rows)
    cells = {(r.stack, r.size): r for r in rows}
    seconds = np.full((len(stacks), len(sizes)), np.nan)
    for (stack, size), row in cells.items():
        if row.seconds is not None:
            seconds[stacks.index(stack), sizes.index(size)] = row.seconds
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 1.5 * len(sizes)), 1.2 + 0.8 * len(stacks)))
    colours = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
    measured = seconds[~np.isnan(seconds)]
    # Times grow about with the pixel count, so a log scale keeps the small sizes apart.
    norm = LogNorm(vmin=measured.min(), vmax=max(measured.max(), measured.min() * 1.01)) if measured.size else None
    image = ax.imshow(np.ma.masked_invalid(seconds), cmap=colours, norm=norm, aspect="auto")
    for (stack, size), row in cells.items():
        y, x = stacks.index(stack), sizes.index(size)
        if row.seconds is None:
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#d99", linewidth=0))
            ax.text(x, y, f"{row.status}\npredicted {format_mib(row.predicted_peak_bytes)} MiB", ha="center", va="center",
                    fontsize=8, color="#a22", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9})
        else:
            colour = "white" if norm is not None and norm(row.seconds) < 0.5 else "black"
            ax.text(x, y, f"{row.seconds:.2f} s\n{format_mib(row.peak_memory_bytes)} MiB", ha="center", va="center",
                    fontsize=8, color=colour)
    ax.set_xticks(range(len(sizes)), [f"{s}²" for s in sizes])
    ax.set_yticks(range(len(stacks)), list(stacks))
    memory = MEMORY_LABELS[rows[0].memory_kind]
    ax.set_title(f"{rows[0].model} on {rows[0].device}: sampler + decode time, peak {memory}", fontsize=9)
    if norm is not None:
        bar = fig.colorbar(image, ax=ax, label="seconds")
        # Ticks at 1, 2, 5, 10, … written as such, not as 2×10⁰.
        bar.ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        bar.ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        bar.ax.yaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
