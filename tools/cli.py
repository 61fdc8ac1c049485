"""Command line: ``python -m sdopt {make-model,make-lora,train-reference,run,serve,soak,bench,plan,doctor,cache} ...``.

Problems with the user's input are raised as ``UserError`` and printed as one line
(``sdopt: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from ..errors import UserError
from ..nodes.stack_choice import GOALS
from .bench_resolutions import STACKS
from .bench_speed import CACHE_RUNGS, CHANNELS_LAST, COMPILE_REGIONAL, RUNGS as SPEED_RUNGS
from .bench_suite import SUITE_LIMIT_S
from .memory_mode import ENVIRONMENT as MEMORY_MODE_ENVIRONMENT, MODES as MEMORY_MODES
from ..families import MODEL_NAMES, resolve_model
from .modelgen import CHECKPOINT_DTYPES, SIZES
from .reference.command import add_train_reference
from .soak import DEFAULT_MODELS as SOAK_MODELS, DEFAULT_PROMPTS as SOAK_PROMPTS, DEFAULT_WARMUP as SOAK_WARMUP



def _make_model(args: argparse.Namespace) -> None:
    from .modelgen import write_checkpoint

    summary = write_checkpoint(args.model, args.out, seed=args.seed, dtype=args.dtype, progress=True,
                               text_encoder_out=args.text_encoder_out)
    family, _ = resolve_model(args.model)
    print(
        f"wrote {summary.path}: {args.model} {family.title} checkpoint, {summary.param_count:,} parameters, "
        f"{summary.file_bytes / 2**20:,.1f} MiB ({args.dtype}, seed {args.seed})"
    )
    if summary.text_encoder_path:
        print(f"wrote {summary.text_encoder_path}: its text encoder, for ComfyUI's CLIPLoader (type {family.clip_type}) "
              "from models/text_encoders")


def _make_lora(args: argparse.Namespace) -> None:
    from .modelgen import write_lora

    summary = write_lora(args.model, args.out, rank=args.rank, seed=args.seed, dtype=args.dtype, progress=True)
    family, _ = resolve_model(args.model)
    print(
        f"wrote {summary.path}: rank-{args.rank} LoRA for {args.model} ({family.title}), {summary.tensor_count // 3} layers, "
        f"{summary.file_bytes / 2**20:,.1f} MiB ({args.dtype}, seed {args.seed})"
    )


def _vram_cap(args: argparse.Namespace) -> int | None:
    from .headless import parse_vram_cap

    return parse_vram_cap(args.vram_cap)


def _run(args: argparse.Namespace) -> None:
    from .headless import run_workflow

    outcome = run_workflow(
        args.workflow,
        comfyui=args.comfyui,
        models=args.models,
        overrides=args.set,
        report_json=args.report_json,
        out_dir=args.out,
        vram_cap=_vram_cap(args),
    )
    print(outcome.report.markdown() if outcome.report else "no sdopt Profile Report node in this workflow: nothing was profiled")
    for image in outcome.images:
        print(f"image: {image}")
    if outcome.report_path is not None:
        print(f"report: {outcome.report_path}")


def _print_rows(table: str, rows: list, json_path: Path | None) -> None:
    print(table)
    if json_path:
        json_path.write_text(json.dumps([row.to_dict() for row in rows], indent=2))
        print(f"wrote {json_path}")


def _bench_attention(args: argparse.Namespace) -> None:
    from .bench_attention import attention_table, bench_attention

    rows = bench_attention(
        tokens=args.tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device=args.device,
        backends=args.backends,
        repeats=args.repeats,
    )
    _print_rows(attention_table(rows), rows, args.json)


def _bench_unet(args: argparse.Namespace) -> None:
    from .bench_unet import bench_unet, unet_table

    rows = bench_unet(
        args.comfyui,
        model=args.model,
        weight_dtypes=args.dtypes,
        resolution=args.resolution,
        batch=args.batch,
        repeats=args.repeats,
        models=args.models,
        vram_cap=_vram_cap(args),
        low_memory_mb=args.low_memory,
    )
    _print_rows(unet_table(rows), rows, args.json)


def _bench_speed(args: argparse.Namespace) -> None:
    from ..measure.step_profile import step_category_table, step_profile_table
    from .bench_speed import bench_speed, bench_speed_isolated, save_plot, speed_table, step_profiles

    bench = bench_speed_isolated if args.isolate else bench_speed
    rows = bench(args.comfyui, model=args.model, size=args.size, steps=args.steps, rounds=args.rounds, rungs=args.rungs,
                 models=args.models, vram_cap=_vram_cap(args), profile=args.profile, trace_dir=args.trace_dir)
    _print_rows("\n\n".join(filter(None, [speed_table(rows), step_profile_table(step_profiles(rows)), step_category_table(step_profiles(rows))])), rows, args.json)
    if args.plot:
        print(save_plot(rows, args.plot) or f"wrote {args.plot}")


def _bench_quality(args: argparse.Namespace) -> None:
    from .bench_quality import bench_quality, quality_table

    rows = bench_quality(args.comfyui, args.model, images=args.images, rungs=args.rungs, models=args.models)
    _print_rows(quality_table(rows), rows, args.json)


def _bench_resolutions(args: argparse.Namespace) -> None:
    from .bench_resolutions import bench_resolutions, resolutions_table, save_heatmap

    rows = bench_resolutions(args.comfyui, model=args.model, sizes=args.sizes, steps=args.steps, vram_cap=_vram_cap(args),
                             confirm=args.confirm, models=args.models, offload_mb=args.offload_mb, against_uncapped=args.against_uncapped,
                             low_memory=args.low_memory, stacks=tuple(args.stacks), auto_goal=args.auto_goal)
    _print_rows(resolutions_table(rows), rows, args.json)
    if args.plot:
        print(save_heatmap(rows, args.plot) or f"wrote {args.plot}")


def _bench_vae(args: argparse.Namespace) -> None:
    from .bench_vae import bench_vae, vae_table

    rows = bench_vae(args.sizes, tile=args.tile, overlap=args.overlap, keep_intermediates=args.keep_intermediates,
                     model=args.model, budget_mb=args.budget_mb or None, seed=args.seed)
    _print_rows(vae_table(rows), rows, args.json)


def _bench_suite(args: argparse.Namespace) -> int:
    from .progress import progress_bar

    from ..measure.report import markdown_table
    from .bench_suite import FAILED, TIMED_OUT, check_budget, plan_phases, run_suite, select, write_suite

    phases = plan_phases(args.model, args.sdxl_model, args.dry_run, str(args.comfyui) if args.comfyui else None,
                         str(args.models) if args.models else None)
    check_budget(phases)
    chosen = select(phases, args.phase)
    if args.list:
        rows = [[p.number, p.name, p.title, f"{p.budget_s / 60:.1f}", p.skip or "—"] for p in chosen]
        print("\n".join(markdown_table(["phase", "name", "what", "planned min (H100)", "skipped (why)"], rows, right={0, 3})))
        return 0
    if args.collect:
        if not args.out.is_dir():
            raise UserError(f"--out {args.out}: no such folder; --collect reads the phases a suite wrote into --out")
        write_suite(args.out)
        print(f"wrote {args.out / 'suite.md'} and {args.out / 'suite.json'} from the phases in {args.out}")
        return 0
    with progress_bar(total=len(chosen), desc="bench suite", unit="phase") as bar:
        def started(phase):
            bar.write(f"phase {phase.number} ({phase.name}): {phase.title}, {phase.budget_s / 60:.1f} min planned")

        def finished(outcome):
            bar.write(f"phase {outcome.number} ({outcome.name}): {outcome.status} in {outcome.seconds:.0f} s"
                      + (f" ({outcome.error.splitlines()[0]})" if outcome.error else ""))
            bar.update()

        outcomes = run_suite(args.out, chosen, args.dry_run, args.archive, args.time_limit, started=started, finished=finished)
    print(f"wrote {args.out / 'suite.md'}" + (f" and {args.archive}" if args.archive else ""))
    return 1 if any(o.status in (FAILED, TIMED_OUT) for o in outcomes) else 0


def _sizes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of pixel sizes, e.g. 512,1024,2048") from None


def _output_file(text: str) -> Path:
    """A file a command writes when it ends: checked, and its folder made, before the command runs, so
    that a long run never ends in a path error that loses what it measured."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name in it, e.g. {path / 'result.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {error.strerror}") from None
    return path


def _output_folder(text: str) -> Path:
    """A folder a command writes into (made by the command): refused up front where a file stands."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; give a folder (it is made if missing)")
    return path


def _offload_mb(text: str) -> int | None:
    """``auto`` (None: the planner's budget per size) or MiB."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number of MiB") from None


def _cache(args: argparse.Namespace) -> None:
    from ..optim.compile import cache_entries, default_cache_dir, foreign_items, purge_cache
    from ..measure.report import markdown_table

    root = args.dir or default_cache_dir()
    foreign = foreign_items(root)
    if args.action == "purge":
        if args.key in foreign:
            raise UserError(f"cache purge: {root / args.key} is not an sdopt cache entry (no meta.json of sdopt's in it); left alone")
        try:
            removed = purge_cache(root, args.key)
        except OSError as error:
            raise UserError(f"cache purge: could not delete {error.filename or root}: {error.strerror or error}; check its permissions") from None
        if args.key and not removed:
            raise UserError(f"cache purge: no entry {args.key!r} in {root}; `python -m sdopt cache list` shows the keys")
        print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} from {root}")
    else:
        entries = cache_entries(root)
        if entries:
            rows = [[e["key"], e.get("settings", "?"), f"{e['bytes'] / 2**20:,.1f}", _cold_compiles(e["compiles"]), e.get("created", "?"), e.get("last_used", "?")]
                    for e in entries]
            print(f"{root}:")
            print("\n".join(markdown_table(["key (architecture-torch-settings)", "settings", "MiB", "cold compile per input signature", "created", "last used"], rows, right={2})))
        else:
            print(f"no sdopt compile cache entries in {root}")
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        print(f"left alone {len(foreign)} item(s) in {root} that sdopt did not write: {shown}")


def _cold_compiles(compiles: dict) -> str:
    cold = [f"{signature}: {kept['cold_seconds']:.1f} s" for signature, kept in compiles.items() if kept.get("cold_seconds") is not None]
    return "; ".join(cold) or "-"


def _doctor(args: argparse.Namespace) -> int:
    import time

    from .progress import progress_bar

    from ..nodes.checks import CHECKS, FAILED, default_device, doctor_table, run_checks, summary
    from .doctor import load_comfyui

    started = time.perf_counter()
    comfyui = None if args.no_comfyui else load_comfyui(args.comfyui)
    device = args.device or default_device(comfyui)
    with progress_bar(total=len(CHECKS), desc="doctor", unit="check") as bar:
        def progress(name):
            bar.set_postfix_str(name)
            bar.update()

        rows = run_checks(device, comfyui, progress)
    print(doctor_table(rows))
    print(f"\n{summary(rows, time.perf_counter() - started)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([row.to_dict() for row in rows], indent=2))
        print(f"wrote {args.json}")
    return 1 if any(row.status == FAILED for row in rows) else 0


def _plan(args: argparse.Namespace) -> None:
    from .plan import run_plan

    run_plan(args)


def _serve(args: argparse.Namespace) -> None:
    from .serve import run_server

    run_server(args.comfyui, args.models, args.port)


def _soak(args: argparse.Namespace) -> int:
    from .soak import soak, write_json

    result = soak(args.comfyui, args.models, prompts=args.prompts, seed=args.seed, port=args.port, max_drift=args.max_drift / 100,
                  warmup=args.warmup, model_names=tuple(args.model or SOAK_MODELS), prompt_timeout=args.prompt_timeout, chaos=args.chaos)
    print(result.summary())
    if args.json:
        write_json(result, args.json, _soak_command(args))
        print(f"wrote {args.json}")
    return 1 if result.problems() else 0


def _soak_command(args: argparse.Namespace) -> str:
    """The command that repeats this soak, every option spelled out (the server's port aside)."""
    models = "".join(f" --model {name}" for name in args.model or SOAK_MODELS)
    return (f"python -m sdopt soak{' --chaos' if args.chaos else ''} --prompts {args.prompts} --seed {args.seed} --warmup {args.warmup} "
            f"--max-drift {args.max_drift:g}{models}"
            f" --comfyui {args.comfyui}" + (f" --models {args.models}" if args.models else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdopt", description="sdopt: generated checkpoints (SD1.5, SDXL, SD3.5, Flux), headless profiled ComfyUI runs, benchmarks, planner, doctor."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-model", help="write a deterministic random-weight checkpoint (SD1.5, SDXL, SD3.5, Flux)")
    make.add_argument("model", choices=MODEL_NAMES)
    make.add_argument("--out", required=True, type=Path, help="the .safetensors file to write")
    make.add_argument("--text-encoder-out", type=Path, default=None,
                      help=("Flux only: its text encoder file (default: <name>-text.safetensors in text_encoders/ beside the checkpoints "
                            "folder when --out is in one, else in text_encoders/ inside --out's folder)"))
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=CHECKPOINT_DTYPES, default="fp16")
    make.set_defaults(handler=_make_model)

    lora = commands.add_parser("make-lora", help="write a deterministic random LoRA (kohya format) for a generated model")
    lora.add_argument("model", choices=MODEL_NAMES)
    lora.add_argument("--out", required=True, type=Path, help="the .safetensors file to write (e.g. into models/loras)")
    lora.add_argument("--rank", type=int, default=4)
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--dtype", choices=CHECKPOINT_DTYPES, default="fp16")
    lora.set_defaults(handler=_make_lora)

    add_train_reference(commands)

    run = commands.add_parser("run", help="run a ComfyUI workflow headless, with sdopt loaded, and profile it")
    run.add_argument("workflow", type=Path, help="workflow JSON, UI or API format")
    run.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    run.add_argument("--models", type=Path, help="extra folder searched for checkpoints (and <kind>/ under it, for each model kind)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="CLASS_OR_TITLE.INPUT=VALUE",
        help="override an input on every matching node; repeatable",
    )
    run.add_argument("--report-json", type=_output_file, help="write the JSON report here too")
    run.add_argument("--out", type=_output_folder, help="output folder for images and reports (default: ComfyUI's output)")
    _add_gpu_memory_options(run)
    run.set_defaults(handler=_run)

    serve = commands.add_parser("serve", help="start ComfyUI with sdopt installed, on localhost")
    serve.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    serve.add_argument("--models", type=Path, required=True, help=(
        "folder with checkpoints/; ComfyUI is offered it and every other sub-folder (text_encoders/, loras/, ...) under its own name"))
    serve.add_argument("--port", type=int, default=8188)
    serve.set_defaults(handler=_serve)

    soak = commands.add_parser("soak", help=(
        "start ComfyUI with sdopt and queue random chains of every sdopt node over HTTP: failed prompts and the server's "
        "RSS drift; exit status 1 on any failure or too much drift"))
    soak.add_argument("--prompts", type=int, default=SOAK_PROMPTS)
    soak.add_argument("--seed", type=int, default=0, help="draws every prompt's chain, size, LoRA and sampler seed (a rerun repeats them)")
    soak.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    soak.add_argument("--models", type=Path, help="folder with checkpoints/ (default: ComfyUI's models folder); a missing mini is generated there")
    soak.add_argument("--model", action="append", choices=[name for name in _COMFYUI_MODELS if resolve_model(name)[1] == "mini"], help=(
        f"the generated model(s) the prompts draw from (repeatable; default the four families' minis: {', '.join(SOAK_MODELS)})"))
    soak.add_argument("--port", type=int, help="default: a free port")
    soak.add_argument("--max-drift", type=float, default=5.0, metavar="PERCENT", help="RSS growth allowed from the warm reading to the end one")
    soak.add_argument("--warmup", type=int, default=SOAK_WARMUP, help=(
        "prompts before the warm RSS reading: torch's one-time set-up for each new mix of Compile and "
        "weight dtypes lands in them"))
    soak.add_argument("--prompt-timeout", type=float, default=600.0, metavar="SECONDS", help="a prompt not ended by then counts as failed")
    soak.add_argument("--chaos", action="store_true", help=(
        "mix in what users do: cancel while sampling, compiling or decoding, free memory, bursts of 10-20 queued prompts, "
        "malformed prompts; then compare every completed image with a fresh server's"))
    soak.add_argument("--json", type=_output_file, help="also write the result, every prompt's chain and error, as JSON")
    soak.set_defaults(handler=_soak, model=None)

    bench = commands.add_parser("bench", help="micro-benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    attention = bench_kinds.add_parser("attention", help="time, peak memory and error of each attention backend")
    attention.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    attention.add_argument("--heads", type=int, default=8)
    attention.add_argument("--head-dim", type=int, default=64)
    attention.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    attention.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    attention.add_argument("--backends", nargs="+", help="default: every backend available here")
    attention.add_argument("--repeats", type=int, default=3)
    attention.add_argument("--json", type=_output_file, help="write the rows as JSON")
    attention.set_defaults(handler=_bench_attention)
    unet = bench_kinds.add_parser(
        "unet", help="UNet latency, memory and error per weight dtype through SDOptPrecision, inside ComfyUI, vs fp32"
    )
    unet.add_argument("--dtypes", nargs="+", choices=("auto", "fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"), default=["auto", "fp16", "bf16"])
    unet.add_argument("--resolution", type=int, default=512, help="image side in pixels (latent is 1/8)")
    unet.add_argument("--batch", type=int, default=2, help="2 = one cond+uncond sampler step")
    unet.add_argument("--repeats", type=int, default=3)
    unet.add_argument("--low-memory", type=int, default=0, metavar="MIB",
                      help="one more row: the fp32 model through SDOptLowMemory at this budget, its working peak and error against fp32's (0 = none)")
    _add_comfyui_bench_options(unet)
    unet.set_defaults(handler=_bench_unet)
    speed = bench_kinds.add_parser(
        "speed", help="steady it/s of each fast-path rung in ComfyUI's KSampler, interleaved with stock ComfyUI"
    )
    speed.add_argument("--size", type=int, default=512, help="image side in pixels")
    speed.add_argument("--steps", type=int, default=20)
    speed.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every rung after the warm-up")
    speed.add_argument("--rungs", nargs="+", default=list(SPEED_RUNGS), help=(
        f"default: all of {', '.join(SPEED_RUNGS)}; also offered: auto (sdopt Auto, fastest, exact: the stack it picks), "
        f"{COMPILE_REGIONAL} (each repeated block compiled once), "
        f"{CHANNELS_LAST}, the step cache rungs ({', '.join(CACHE_RUNGS)}), fp8_matmul and fp8_matmul+compile+graph "
        "(Precision's fp8 matmuls with fp8_e4m3fn weights, eager, and compiled and graphed), fp8_e4m3fn_fast (ComfyUI's own "
        "fp8 fast path, as Load Diffusion Model loads it), and diffusers and "
        "diffusers+compile (diffusers' own UNet and pipeline on the same weights: fp16, SDPA, channels-last, torch.compile max-autotune)"))
    speed.add_argument("--plot", type=_output_file, help="write a bar chart (PNG)")
    speed.add_argument("--profile", action="store_true",
                       help="profile one more prompt per rung: the device's busy time per step, what bounds the step, host syncs, top kernels, each op category's share of the step and the ops outside compiled graphs")
    speed.add_argument("--trace-dir", type=_output_folder, help="keep each profiled prompt as a Perfetto trace, RUNG.trace.json.gz (implies --profile)")
    speed.add_argument("--isolate", action="store_true", help=(
        "each rung in a fresh process beside a stock run of its own, with empty compiler caches: cold compile "
        "times that do not depend on the rungs' order (one model load per rung)"))
    _add_comfyui_bench_options(speed)
    speed.set_defaults(handler=_bench_speed)
    quality = bench_kinds.add_parser("quality", help=(
        "on a reference model: each setting's prompt accuracy, PSNR and SSIM against stock, model calls and speed, "
        "beside stock at fewer steps"))
    quality.add_argument("--model", default="ref-sd15", help="a reference model (trained here): ref-sd15")
    quality.add_argument("--images", type=int, default=32, help="(caption, seed) pairs per rung")
    quality.add_argument("--rungs", nargs="+", help="default: every rung this model and device run (stock always)")
    quality.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    quality.add_argument("--models", type=Path, help="folder with checkpoints/ (default: ComfyUI's models folder)")
    quality.add_argument("--json", type=_output_file, help="write the rows as JSON")
    quality.set_defaults(handler=_bench_quality)
    resolutions = bench_kinds.add_parser(
        "resolutions", help="stock vs sdopt's low-memory stack vs sdopt Auto per image size: time, peak memory, OOM, prediction")
    resolutions.add_argument("--sizes", type=_sizes, default=[512, 1024, 2048], help="comma-separated image sides in pixels")
    resolutions.add_argument("--steps", type=int, default=4)
    resolutions.add_argument("--offload-mb", type=_offload_mb, default=1024, help=(
        "the sdopt stack's Offload budget in MiB of UNet weights; 0 = sequential (stream every layer); auto = the "
        "planner's per size: as much of the UNet as the cap leaves beside the step (as `plan` offers it)"))
    resolutions.add_argument("--low-memory", choices=("always", "when-needed"), default="always", help=(
        "wire sdopt Low Memory into every sdopt cell, or only where the planner predicts the step does not fit "
        "without it (Offload and an untiled decode change no number, so those cells equal stock's uncapped image)"))
    resolutions.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS), help="the stacks run at each size")
    resolutions.add_argument("--auto-goal", choices=GOALS, default="fastest", help="the auto stack's goal (sdopt Auto's goal)")
    resolutions.add_argument("--confirm", action="store_true",
                             help="on a GPU, also run the cells the planner predicts out of memory (on a CPU they are never run)")
    resolutions.add_argument("--against-uncapped", action="store_true", help=(
        "before each size, run stock once more with --vram-cap lifted and compare both stacks' images with it"))
    resolutions.add_argument("--plot", type=_output_file, help="write a heatmap (PNG)")
    _add_comfyui_bench_options(resolutions)
    resolutions.set_defaults(handler=_bench_resolutions)
    vae = bench_kinds.add_parser(
        "vae", help="VAE decode untiled vs tiled (a generated model's VAE), each in a fresh process: time, peak RAM, PSNR"
    )
    vae.add_argument("--sizes", type=_sizes, default=[512, 1024], help="comma-separated image sides in pixels")
    vae.add_argument("--tile", type=int, default=512, help="tile side in image pixels")
    vae.add_argument("--overlap", type=int, default=0, help="image pixels cross-faded between tiles")
    vae.add_argument("--keep-intermediates", nargs="+", choices=("no", "yes", "auto"), default=["no", "yes"],
                     help="one tiled run per value: no = recompute (least memory), yes = keep (faster), auto = by budget")
    vae.add_argument("--budget-mb", type=int, default=0, help="memory budget for auto (0 = free RAM)")
    vae.add_argument("--model", choices=SIZES, default="full",
                     help="whose VAE, with the weights make-model writes (mini and full: SD1.5's; sdxl-mini: SDXL's, fp16-overflowing)")
    vae.add_argument("--seed", type=int, default=0)
    vae.add_argument("--json", type=_output_file, help="write the rows as JSON")
    vae.set_defaults(handler=_bench_vae)

    suite = bench_kinds.add_parser("suite", help=(
        "everything a GPU must show, phase by phase, each in its own process: tests/gpu, doctor, bench speed (SD1.5 ladder, "
        "competitors, SDXL), attention, VAE with an injected OOM retry, resolutions under 8/4/2 GiB, offload, step caches, "
        "Flux under a 12 GiB cap, diffusers+compile"))
    suite.add_argument("--out", type=_output_folder, required=True, help="folder for each phase's JSON, markdown section and plots, and suite.md")
    suite.add_argument("--phase", type=int, action="append", help="run only this phase (repeatable, run in the order given; --list shows them)")
    suite.add_argument("--model", help="the SD1.5 model of the speed, resolution and offload phases (default full; mini with --dry-run)")
    suite.add_argument("--sdxl-model", default="sdxl-full", help="the SDXL model of the speed-sdxl phase")
    suite.add_argument("--dry-run", action="store_true", help="the same plan at tiny sizes on a CPU, leaving out what takes minutes there")
    suite.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    suite.add_argument("--models", type=Path, help="folder with checkpoints/ (default: ComfyUI's models folder)")
    suite.add_argument("--archive", type=_output_file, help="also keep a .tar.gz of --out, rewritten after each phase")
    suite.add_argument("--time-limit", type=float, default=SUITE_LIMIT_S, metavar="SECONDS", help=(
        "this run's limit (default the suite's 40 min): a phase that would pass it is skipped, the running one stopped at it"))
    _add_memory_mode(suite)
    suite.add_argument("--list", action="store_true", help="print the plan (phases, planned minutes, what is skipped) and stop")
    suite.add_argument("--collect", action="store_true", help="only rebuild suite.md and suite.json from the phase files in --out")
    suite.set_defaults(handler=_bench_suite)

    plan = commands.add_parser(
        "plan", help="predict each stage's peak memory (fake tensors, nothing runs) and the settings that fit a budget"
    )
    plan.add_argument("--model", help=(
        f"a generated model ({', '.join(MODEL_NAMES)}) or a .safetensors file of one of their architectures; default mini; "
        "with --check, only that model's cases"))
    plan.add_argument("--width", type=int, default=512, help="image width in pixels, a multiple of 64")
    plan.add_argument("--height", type=int, default=512, help="image height in pixels, a multiple of 64")
    plan.add_argument("--budget", default="8GiB", help="memory budget, e.g. 8GiB, 2048MiB, 512MB")
    plan.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="weights and activations")
    plan.add_argument("--workspace", choices=("cpu", "cuda", "none"), default="cpu", help="whose hidden kernel temporaries to add")
    plan.add_argument("--no-search", action="store_true", help="skip the search for the largest square that fits")
    plan.add_argument("--json", type=_output_file, help="write the plan as JSON")
    plan.add_argument("--check", action="store_true", help=(
        "instead of a plan: the predicted peaks of the CPU accuracy cases (full VAE decode 512-2048, mini UNet step "
        "512 and 1024, sdxl-mini UNet step 512-2048, every stage of sd35-mini and flux-mini) against real runs, "
        "each in a fresh process: peak RSS on this CPU, or with --workspace cuda torch's peak allocated memory on the GPU "
        "(give --dtype fp16 or bf16 there)"))
    plan.add_argument("--repeats", type=int, default=3, help="--check: fresh processes per case (the median counts)")
    plan.add_argument("--max-size", type=int, default=2048, help="--check: leave out larger cases (the untiled 2048 decode needs 16 GiB)")
    plan.set_defaults(handler=_plan)

    doctor = commands.add_parser("doctor", help=(
        "try what sdopt needs here, one tiny run each (device, dtypes, attention backends, inductor, CUDA graphs, ComfyUI, "
        "compile cache, each node's modes): the result, and the fix for what does not work; exit status 1 when a check failed"))
    doctor.add_argument("--json", type=_output_file, help="also write the rows as JSON, one object per check")
    doctor.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    doctor.add_argument("--no-comfyui", action="store_true", help="leave ComfyUI out")
    doctor.add_argument("--device", help="default: ComfyUI's device, else cuda when present, else cpu")
    doctor.set_defaults(handler=_doctor)

    cache = commands.add_parser("cache", help="list or purge the compiled-code cache of sdopt Compile (its entries only)")
    cache_actions = cache.add_subparsers(dest="action", required=True)
    cache_dir = argparse.ArgumentParser(add_help=False)
    cache_dir.add_argument("--dir", type=Path, help="default: $SDOPT_CACHE_DIR, else sdopt/compile in $XDG_CACHE_HOME or ~/.cache")
    cache_actions.add_parser("list", parents=[cache_dir], help="the entries: key, settings, size, cold compile times, dates")
    purge = cache_actions.add_parser("purge", parents=[cache_dir], help="delete the entries sdopt wrote (nothing else in the folder)")
    purge.add_argument("key", nargs="?", help="purge only this entry (a key from `cache list`)")
    cache.set_defaults(handler=_cache, key=None)
    return parser


def _add_gpu_memory_options(parser: argparse.ArgumentParser) -> None:
    """--vram-cap and --memory-mode, for every command that boots ComfyUI to sample."""
    parser.add_argument("--vram-cap", metavar="SIZE", help=(
        "emulate a smaller GPU, e.g. 8GiB: PyTorch and ComfyUI's model loading keep within it (CUDA only; ignored on a CPU)"))
    _add_memory_mode(parser)


def _add_memory_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory-mode", choices=MEMORY_MODES, help=(
        "ComfyUI's memory management: auto (the default, or $SDOPT_MEMORY_MODE) starts ComfyUI 0.38's dynamic VRAM where "
        "its server would (an NVIDIA GPU or AMD on ROCm 7.14+, comfy-aimdo installed); classic keeps it off; dynamic insists on it"))


# The generated models ComfyUI loads (the tiny ones are for unit tests only).
_COMFYUI_MODELS = tuple(name for name in MODEL_NAMES if resolve_model(name)[1] != "tiny")


def _add_comfyui_bench_options(parser: argparse.ArgumentParser) -> None:
    """The options of every bench that runs inside ComfyUI."""
    parser.add_argument("--model", default="mini", help=f"{', '.join(_COMFYUI_MODELS)} (generated once) or a checkpoint file")
    parser.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"), help="default: $COMFYUI_PATH")
    parser.add_argument("--models", type=Path, help="folder with checkpoints/ (default: ComfyUI's models folder)")
    parser.add_argument("--json", type=_output_file, help="write the rows as JSON")
    _add_gpu_memory_options(parser)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _memory_mode_for_this_run(mode: str | None):
    """``--memory-mode`` for this command and every process it starts (fresh-process benches, suite
    phases), through the environment; restored after, so a caller's later commands keep their own."""
    if mode is None:
        yield
        return
    before = os.environ.get(MEMORY_MODE_ENVIRONMENT)
    os.environ[MEMORY_MODE_ENVIRONMENT] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[MEMORY_MODE_ENVIRONMENT]
        else:
            os.environ[MEMORY_MODE_ENVIRONMENT] = before


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _memory_mode_for_this_run(getattr(args, "memory_mode", None)):
            status = args.handler(args)
    except UserError as error:
        print(f"sdopt: error: {error}", file=sys.stderr)
        return 2
    return status or 0
