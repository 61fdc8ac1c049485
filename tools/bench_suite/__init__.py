"""``python -m sdopt bench suite``: everything a lent GPU must show, in phases, each in its own process.

The plan (``plan_phases``) is fixed and numbered, so ``--phase N`` names the same phase everywhere:

1. gpu-tests: ``pytest tests/gpu``;
2. doctor: ``python -m sdopt doctor``;
3. speed: ``bench speed``, the SD1.5 ladder at 512², 20 steps, the channels-last rung included;
4. competitors: ``bench speed`` with stock ComfyUI, sdopt's fastest rung, ComfyUI's TorchCompileModel and
   diffusers' own UNet and pipeline;
5. speed-sdxl: the SDXL ladder at 1024², planned once ``bench speed`` knows ``--sdxl-model``;
6. attention: ``bench attention``, every registered backend, fp16;
7. vae: VAE decode on the device: untiled, tiled within a budget, and tiled with an out-of-memory error
   injected into the first try, which the tiler must retry with smaller tiles;
8-10. res-8gib, res-4gib, res-2gib: ``bench resolutions`` under each ``--vram-cap``;
11. offload: sdopt Offload's modes: MiB resident, steady it/s, peak memory, output against full residency;
12. cache: the step caches, sdopt's and ComfyUI's EasyCache, plain and compiled;
13. flux-12gib: Flux under a 12 GiB cap through sdopt Offload, against the uncapped model;
14. diffusers-compile: diffusers' pipeline with its torch.compile max-autotune recipe, beside stock. Apart
    from phase 4 because max-autotune's compile time is unknown on the device: a phase stopped at its
    limit keeps nothing, and phase 4's rows must not wait on it.

Each phase has a budget of planned seconds on an H100 (at most ``PHASE_LIMIT_S``, together at most
``SUITE_LIMIT_S``); a phase that would take the suite past its limit is skipped, with the reason, and
a running phase is stopped at ``PHASE_LIMIT_S``. Each phase runs in a child process and writes
``NN-name.json`` (its rows, what it skipped and why), ``NN-name.md`` (its section) and its plots into the
output folder as it finishes; ``suite.md`` and ``suite.json`` are rebuilt from the phases present after
each one, so a phase that breaks, or a machine taken back, never loses the ones before. ``archive``
keeps a .tar.gz of the folder up to date after each phase.

``dry_run`` runs the same plan at tiny sizes on a CPU (CI does), leaving out what takes minutes there
(each compiling rung, the SDXL checkpoint) and saying so.

One subject per module:

- ``phases``: the plan, each phase's options and budget, and which phases run;
- ``runner``: the parent, one child process per phase, and the files it keeps;
- ``child``: the phases themselves, run in the child (``python -m`` that module; nothing here imports it).
"""
from .phases import PHASE_LIMIT_S, SUITE_LIMIT_S, Phase, check_budget, over_budget, plan_phases, select
from .runner import (
    DONE,
    FAILED,
    PARTIAL,
    SKIPPED,
    TIMED_OUT,
    PhaseOutcome,
    run_suite,
    skip_summary,
    write_archive,
    write_phase,
    write_suite,
)

__all__ = [
    "DONE", "FAILED", "PARTIAL", "PHASE_LIMIT_S", "SKIPPED", "SUITE_LIMIT_S", "TIMED_OUT", "Phase", "PhaseOutcome",
    "check_budget", "over_budget", "plan_phases", "run_suite", "select", "skip_summary", "write_archive", "write_phase",
    "write_suite",
]
