"""The suite's plan: its numbered phases, each with its options (tiny on a CPU in a dry run) and its budget
of planned seconds, and which of them run within the suite's limit."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...errors import UserError
from ..bench_speed import COMPILING_RUNGS

PHASE_LIMIT_S = 9 * 60
SUITE_LIMIT_S = 40 * 60
SPEED_LADDER = ["stock", "precision", "attention", "trace", "compile", "graph", "compile+graph", "compile+graph+channels_last", "TorchCompileModel"]
COMPETITORS = ["stock", "compile+graph+channels_last", "TorchCompileModel", "diffusers"]
DIFFUSERS_COMPILED = ["stock", "diffusers+compile"]
SDXL_LADDER = ["stock", "attention", "compile+graph+channels_last", "TorchCompileModel"]
CACHES = ["stock", "compile+graph", "cache", "compile+graph+cache", "EasyCache", "compile+graph+EasyCache"]
CPU_COMPILE_SKIP = "left out of the dry run: each compile of the UNet takes a minute or more on a CPU"
DRY_PRECISION_SKIP = "left out of the dry run: the attention rung runs the same Precision node beneath it"
# (mode, budget MiB, VRAM cap GiB or None); the first is every row's reference
OFFLOAD_MODES = (("none", 0, None), ("budget", 1024, None), ("budget", 256, None), ("sequential", 0, None), ("unload_after", 0, None))
FLUX_MODEL = "flux-full"
# Issue 17's 12 GiB card: Flux-dev's 22.2 GiB of bf16 weights, 8 GiB of them resident, beside the
# activations and the VAE decode.
FLUX_CAPPED_MODES = (("none", 0, None), ("budget", 8192, 12))


@dataclass(frozen=True)
class Phase:
    """One numbered phase: ``runner`` names the function of ``child`` that runs it in the child process
    with ``options``; ``budget_s`` is its planned time on an H100; ``skip`` says why it will not run."""

    number: int
    name: str
    title: str
    runner: str
    budget_s: int
    options: dict = field(default_factory=dict)
    skip: str = ""

    @property
    def stem(self) -> str:
        return f"{self.number:02d}-{self.name}"


def _sdxl_known(model: str) -> bool:
    """Whether the generated models (and so ``bench speed``) include ``model``."""
    from ..modelgen import SIZES

    return model in SIZES


def plan_phases(model: str | None = None, sdxl_model: str = "sdxl-full", dry_run: bool = False, comfyui: str | None = None,
                models: str | None = None) -> list[Phase]:
    """The suite's phases in order, with their options (tiny on a CPU for ``dry_run``) and budgets.
    ``model``: the SD1.5 model of phases 3, 4 and 8-11 (default full; mini in a dry run)."""
    common = {"comfyui": comfyui, "models": models}
    model = model or ("mini" if dry_run else "full")
    speed = {"size": 64, "steps": 2, "rounds": 1} if dry_run else {"size": 512, "steps": 20, "rounds": 3}

    def skip_rungs(rungs):
        if not dry_run:
            return {}
        skipped = {rung: CPU_COMPILE_SKIP for rung in rungs if rung in COMPILING_RUNGS}
        return {**skipped, "precision": DRY_PRECISION_SKIP} if "precision" in rungs else skipped
    phases = [
        Phase(1, "gpu-tests", "tests/gpu", "run_gpu_tests", 360),
        Phase(2, "doctor", "sdopt doctor", "run_doctor", 30, {"comfyui": comfyui}),
        Phase(3, "speed", f"bench speed: the SD1.5 ladder ({model})", "run_speed", 210,
              {**common, "model": model, **speed, "rungs": SPEED_LADDER, "skip_rungs": skip_rungs(SPEED_LADDER)}),
        Phase(4, "competitors", f"bench speed: sdopt against TorchCompileModel and diffusers ({model})", "run_speed", 210,
              {**common, "model": model, **speed, "rungs": COMPETITORS, "skip_rungs": skip_rungs(COMPETITORS)}),
        Phase(5, "speed-sdxl", f"bench speed: the SDXL ladder ({sdxl_model})", "run_speed", 300,
              {**common, "model": sdxl_model, "size": 1024, "steps": 20, "rounds": 2, "rungs": SDXL_LADDER, "skip_rungs": {}}),
        Phase(6, "attention", "bench attention: every backend", "run_attention", 30,
              {"tokens": [64, 256], "dtype": "fp32", "device": "cpu"} if dry_run else
              {"tokens": [1024, 4096, 16384], "dtype": "fp16", "device": "cuda"}),
        Phase(7, "vae", "VAE decode on the device, with an injected out-of-memory retry", "run_vae", 90,
              {"model": "tiny", "sizes": [128], "budget_mb": 64} if dry_run else {"model": "full", "sizes": [1024, 2048, 4096], "budget_mb": 1024}),
    ]
    # sdopt Auto beside the hand-wired stacks under 8 GiB, with goal fit: completing the largest size is what
    # this phase measures (goal fastest would compile at every size; bench speed's auto rung measures that).
    # The resolution phases took 34-51 s each on an H100 (docs/benchmarks-log.md).
    for number, cap, sizes, offload_mb, budget, stacks in (
            (8, 8, [1024, 2048, 4096], 1024, 240, ("stock", "sdopt", "auto")), (9, 4, [1024, 2048, 3072], 1024, 60, ("stock", "sdopt")),
            (10, 2, [512, 1024, 2048], 0, 90, ("stock", "sdopt"))):
        options = {**common, "model": model, "sizes": [64] if dry_run else sizes, "steps": 2 if dry_run else 4,
                   "vram_cap_gib": cap, "offload_mb": offload_mb, "stacks": list(stacks), "auto_goal": "fit"}
        phases.append(Phase(number, f"res-{cap}gib", f"bench resolutions with VRAM capped at {cap} GiB", "run_resolutions", budget, options))
    phases.append(Phase(11, "offload", "sdopt Offload: residency, speed and output per mode", "run_offload", 60,
                        {**common, "model": model, "size": 64 if dry_run else 512, "steps": 2 if dry_run else 20, "warm_up": not dry_run,
                         # on a CPU every mode is the same no-op: two show the table's making
                         "modes": [OFFLOAD_MODES[0], OFFLOAD_MODES[3]] if dry_run else list(OFFLOAD_MODES)}))
    phases.append(Phase(12, "cache", f"bench speed: step caches, sdopt's and ComfyUI's EasyCache, plain and compiled ({model})", "run_speed", 240,
                        {**common, "model": model, **speed, "rungs": CACHES, "skip_rungs": skip_rungs(CACHES)}))
    phases.append(Phase(13, "flux-12gib", f"Flux ({FLUX_MODEL}) under a 12 GiB cap through sdopt Offload, against the uncapped model", "run_offload", 300,
                        {**common, "model": FLUX_MODEL, "size": 1024, "steps": 8, "warm_up": True, "modes": list(FLUX_CAPPED_MODES)},
                        skip=("left out of the dry run: phase 11 runs the same runner on the CPU, where a cap does not apply"
                              if dry_run else "")))
    phases.append(Phase(14, "diffusers-compile", f"bench speed: diffusers with torch.compile max-autotune ({model})", "run_speed", 180,
                        {**common, "model": model, **speed, "rungs": DIFFUSERS_COMPILED, "skip_rungs": skip_rungs(DIFFUSERS_COMPILED)},
                        skip=("left out of the dry run: its one rung beside stock compiles, which takes minutes on a CPU"
                              if dry_run else "")))
    if dry_run:
        phases[4] = replace(phases[4], skip="left out of the dry run: generating and loading an SDXL checkpoint takes minutes on a CPU")
        phases[8] = replace(phases[8], skip="left out of the dry run: phase 8's runner and stacks at another cap (phase 10 runs "
                                            "the sequential-offload stack)")
    elif not _sdxl_known(sdxl_model):
        phases[4] = replace(phases[4], skip=f"bench speed has no {sdxl_model} model yet (the generated models are listed by `python -m sdopt make-model -h`)")
    return phases


def check_budget(phases: list[Phase]) -> None:
    """Every phase within ``PHASE_LIMIT_S`` and the planned ones within ``SUITE_LIMIT_S`` together."""
    for phase in phases:
        if phase.budget_s > PHASE_LIMIT_S:
            raise ValueError(f"phase {phase.number} ({phase.name}) plans {phase.budget_s} s, above the {PHASE_LIMIT_S} s a phase may take")
    total = sum(phase.budget_s for phase in phases if not phase.skip)
    if total > SUITE_LIMIT_S:
        raise ValueError(f"the planned phases take {total} s together, above the suite's {SUITE_LIMIT_S} s")


def select(phases: list[Phase], numbers: list[int] | None) -> list[Phase]:
    """The phases named by ``numbers``, in the order given (a short device lease runs what matters
    first), each once; every phase when none is named."""
    if not numbers:
        return phases
    known = {phase.number for phase in phases}
    unknown = [n for n in numbers if n not in known]
    if unknown:
        raise UserError(f"--phase {unknown[0]}: choose from {', '.join(f'{p.number} ({p.name})' for p in phases)}")
    by_number = {phase.number: phase for phase in phases}
    return [by_number[n] for n in dict.fromkeys(numbers)]


def over_budget(phase: Phase, elapsed_s: float, limit_s: float = SUITE_LIMIT_S) -> str:
    """Why ``phase`` must not start after ``elapsed_s`` of the suite, or ''."""
    if elapsed_s + phase.budget_s > limit_s:
        return (f"it plans {phase.budget_s / 60:.1f} min and the suite has run {elapsed_s / 60:.1f} of its "
                f"{limit_s / 60:.0f} min; run it on its own with --phase {phase.number}")
    return ""
