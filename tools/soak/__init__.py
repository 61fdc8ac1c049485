"""``python -m sdopt soak``: many random prompts through a real ComfyUI server, counting failures and memory drift.

The command starts ComfyUI itself (``serve``: the pack linked into ``custom_nodes``, the checkpoints
offered, a free localhost port, temporary output, user and database locations), then queues
``--prompts`` prompts over HTTP (``POST /prompt``, then ``/history/<id>`` until the prompt ends),
one at a time. Each prompt is a random chain drawn from ``--seed``:

- the checkpoint, one of ``--model`` (repeatable; by default the SD1.5, SDXL, SD3.5 and Flux minis); a family whose
  text encoder is a file of its own (sdopt's Flux) encodes through ComfyUI's CLIPLoader;
- the MODEL path: sdopt Precision, Attention, Low Memory, Offload, Compile, CUDA Graph and Step Cache
  (either mode on any family: the one that does not fit the model passes it through with a note),
  each in or out, in random order, with random settings, ComfyUI's LoraLoaderModelOnly (a generated
  rank-4 LoRA for the checkpoint's family) at a random place in it or absent, and sdopt Profiler last;
- the VAE path: sdopt VAE Precision, VAE Attention and Tiled VAE, in or out, in random order;
- sdopt Profile Report on the decoded image, or not;
- a random size (64 to 128 px a side, multiples of 32), 2 steps, a random sampler, scheduler, CFG and seed.

Any 5 consecutive prompts use every node listed, and the first three warm-up prompts run Compile, in
each of its modes in turn, so that torch's one-time set-up of each lands in the warm-up.
sdopt Doctor is left out: it runs the whole ``doctor`` check list, not a patch. Settings are those
that run on any device; Compile, in each of its modes (whole-model compile twice as often as the
others), uses the ``aot_eager`` and ``eager`` backends or ``trace`` (no inductor), so a prompt takes
seconds on a CPU, not the minutes of an inductor build, at the cost of not soaking inductor's generated
code; VAE Precision is never asked for bf16 explicitly (see ``_vae_precision``). 100 prompts of the
SD1.5 mini took 8–11 minutes on 2 idle CPU cores, 29 minutes on 2 shared ones; 100 chaos prompts of the
four families, with their fresh-server rerun, 63 minutes on 2 shared ones (docs/benchmarks-log.md).

The server's resident memory (RSS) is read after a fixed probe prompt (the checkpoint with no sdopt
node), so every reading sees the same cached state, and after ComfyUI has unloaded its models and
collected garbage (``POST /free``), so that cycles a prompt left for the collector are not counted:
ComfyUI collects on its own only every 10 s, and without this one reading could stand hundreds of MiB
above the next (docs/benchmarks-log.md, Soak). RSS is read once the warm-up prompts are done, after every
``READING_EVERY`` prompts, and after the last one. The warm RSS is the median
of the first ``ENDS`` readings and the end RSS the median of the last ``ENDS`` (fewer where there are
fewer readings: a short soak compares its first reading with its last); drift = (end - warm) / warm.
A leak climbs through every reading and moves both medians apart. The command exits 1 when a prompt failed
(an error in its history, rejected by the server, or no end within ``--prompt-timeout``) or the
drift passes ``--max-drift``. The server is stopped, and the link and the temporary folders
removed, whatever happens.

The nodes drawn are those ``nodes/registry.py`` registers (``drawn_nodes``): a registered node the soak
does not cover stops it before it starts. One subject per module:

- ``drawn_nodes``: which registered nodes a prompt draws, and their random settings;
- ``prompts``: a prompt drawn from the seed and its index, and the probe prompt;
- ``server``: ComfyUI's HTTP API as the soak uses it, the server's memory and environment;
- ``verdict``: how each prompt ended, the readings, the drift and what fails the soak;
- ``chaos``: ``--chaos``, users' disruptions mixed in and each image held to a fresh server's;
- ``run``: the soak itself and its JSON.
"""
from .drawn_nodes import PROFILER, REPORT, soak_nodes
from .prompts import DEFAULT_WARMUP, GROUPS, LORA, SoakModel, SoakPrompt, plan_prompt, probe_prompt
from .run import DEFAULT_MODELS, DEFAULT_PROMPTS, soak, write_json
from .server import SUCCESS, history_error
from .verdict import PromptOutcome, SoakResult, drift, problems, reading_points

__all__ = [
    "DEFAULT_MODELS", "DEFAULT_PROMPTS", "DEFAULT_WARMUP", "GROUPS", "LORA", "PROFILER", "REPORT", "SOAK_NODES", "SUCCESS", "PromptOutcome",
    "SoakModel", "SoakPrompt", "SoakResult", "drift", "history_error", "plan_prompt", "probe_prompt", "problems",
    "reading_points", "soak", "soak_nodes", "write_json",
]


def __getattr__(name):
    # SOAK_NODES is read from the registry when first asked for, so that importing the soak (the CLI does,
    # for its defaults) neither imports the nodes nor fails on one the soak does not cover.
    if name == "SOAK_NODES":
        return soak_nodes().all
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
