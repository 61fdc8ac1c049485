"""``python -m sdopt soak``: many random prompts through a real ComfyUI server, counting failures and memory drift.

The command starts ComfyUI itself (``serve``: the pack linked into ``custom_nodes``, the checkpoints
offered, a free localhost port, temporary output, user and database locations), then queues
``--prompts`` prompts over HTTP (``POST /prompt``, then ``/history/<id>`` until the prompt ends),
one at a time. Each prompt is a random chain drawn from ``--seed``:

- the checkpoint, one of ``--model`` (repeatable: SD1.5, SDXL, SD3.5 and Flux minis); a family whose
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
SD1.5 mini took 8–11 minutes on 2 idle CPU cores, 29 minutes on 2 shared ones (docs/benchmarks.md).

The server's resident memory (RSS) is read after a fixed probe prompt (the checkpoint with no sdopt
node), so every reading sees the same cached state, and after ComfyUI has unloaded its models and
collected garbage (``POST /free``), so that cycles a prompt left for the collector are not counted:
ComfyUI collects on its own only every 10 s, and without this one reading could stand hundreds of MiB
above the next (docs/benchmarks.md, Soak). RSS is read once the warm-up prompts are done, after every
``READING_EVERY`` prompts, and after the last one. The warm RSS is the median
of the first ``ENDS`` readings and the end RSS the median of the last ``ENDS`` (fewer where there are
fewer readings: a short soak compares its first reading with its last); drift = (end - warm) / warm.
A leak climbs through every reading and moves both medians apart. The command exits 1 when a prompt failed
(an error in its history, rejected by the server, or no end within ``--prompt-timeout``) or the
drift passes ``--max-drift``. The server is stopped, and the link and the temporary folders
removed, whatever happens.
"""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..families import resolve_model
from ..optim.compile import MODES as COMPILE_MODES
from .progress import progress_bar

DEFAULT_PROMPTS = 100
# Read after every prompt, seed 0's SD1.5 soak (docs/benchmarks.md, Soak) climbs about 160 MiB over its first
# 30 prompts, in steps at prompts that trace or compile a mix of weight dtype and memory format not met
# before (torch's one-time set-up for it), then wanders within 100 MiB: the warm-up covers the steps.
DEFAULT_WARMUP = 35
DEFAULT_MAX_DRIFT = 0.05
READING_EVERY = 10  # prompts between two RSS readings after the warm-up
ENDS = 3  # readings whose median is the warm (first ones) and the end (last ones) RSS
PROMPT_TIMEOUT_S = 600.0
SIDES = (64, 96, 128)
STEPS = (2,)
SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m")
SCHEDULERS = ("normal", "karras")
# Any this many consecutive prompts force every node in at least once (node j into prompts k with k % GROUPS == j % GROUPS).
GROUPS = 5
PROBABILITY = 0.4  # of a node not forced in
LORA = "LoraLoaderModelOnly"
PROFILER = "SDOptProfiler"
REPORT = "SDOptProfileReport"
CLIENT_ID = "sdopt-soak"
SUCCESS = "success"


def _precision(rng: random.Random) -> dict:
    return {"weight_dtype": rng.choice(("auto", "default", "fp32", "bf16", "fp16", "fp8_e4m3fn")),
            "compute_dtype": rng.choice(("default", "fp32", "bf16")), "tf32": rng.random() < 0.5,
            "channels_last": rng.random() < 0.5}


def _attention(rng: random.Random) -> dict:
    return {"backend": rng.choice(("auto", "low_memory", "sdpa", "sdpa_fused", "sliced", "sub_quadratic", "naive", "xformers")),
            "on_unavailable": "fallback", "slice_size": rng.choice((0, 0, 256)), "memory_budget_mb": rng.choice((1, 32))}


def _low_memory(rng: random.Random) -> dict:
    return {"budget_mb": rng.choice((1, 16, 256)), "sequential_cfg": rng.random() < 0.5, "chunk_ops": rng.random() < 0.5}


def _offload(rng: random.Random) -> dict:
    return {"mode": rng.choice(("none", "budget", "sequential", "unload_after")), "budget_mb": rng.choice((0, 64, 1024)),
            "on_unavailable": "fallback"}


COMPILE = "SDOptCompile"
# The first warm-up prompts run Compile in each of its modes, so that torch's one-time set-up of dynamo
# and of TorchScript (75-80 MiB each, docs/benchmarks.md), and that of regional compile's dynamic
# shapes, lands in the warm-up, not in the drift.
COMPILE_MODES_FIRST = COMPILE_MODES


def _compile(rng: random.Random) -> dict:
    return {"mode": rng.choice(("compile",) + COMPILE_MODES), "backend": rng.choice(("aot_eager", "eager")),
            "compile_mode": "default", "dynamic": False, "fullgraph": False, "on_unavailable": "fallback"}


def _cuda_graph(rng: random.Random) -> dict:
    return {"max_graphs": rng.choice((1, 4)), "on_unavailable": "fallback"}


def _step_cache(rng: random.Random) -> dict:
    # Either mode on any family: the mode that does not fit the model must pass it through with a note.
    return {"mode": rng.choice(("deepcache", "first_block")), "interval": rng.choice((1, 2, 3)), "branch": rng.choice((0, 1)),
            "start": rng.choice((0.0, 0.2)), "end": rng.choice((0.8, 1.0)), "on_unavailable": "fallback",
            "threshold": rng.choice((0.0, 0.08, 0.5))}


def _profiler(rng: random.Random) -> dict:
    return {"label": rng.choice(("soak", "fast path"))}


def _vae_precision(rng: random.Random) -> dict:
    # No explicit bf16: on a CPU without bf16 convolutions one 64 px decode takes over a minute in it; auto
    # still picks bf16 where it measured faster.
    return {"dtype": rng.choice(("auto", "default", "fp32")), "nan_guard": rng.random() < 0.5}


def _tiled_vae(rng: random.Random) -> dict:
    tile = rng.choice((0, 64, 96))
    return {"tile": tile, "overlap": rng.choice((0, 16)) if tile else 0, "only_when_needed": rng.random() < 0.5,
            "budget_mb": rng.choice((0, 64))}


# The sdopt nodes a soak prompt draws from, with their random settings; the Profiler goes last on the
# MODEL path (where its tooltip says it belongs) and the Report on the decoded image.
MODEL_NODES: dict[str, Callable[[random.Random], dict]] = {
    "SDOptPrecision": _precision, "SDOptAttention": _attention, "SDOptLowMemory": _low_memory,
    "SDOptOffload": _offload, COMPILE: _compile, "SDOptCUDAGraph": _cuda_graph, "SDOptStepCache": _step_cache,
}
VAE_NODES: dict[str, Callable[[random.Random], dict]] = {
    "SDOptVAEPrecision": _vae_precision, "SDOptVAEAttention": _attention, "SDOptTiledVAE": _tiled_vae,
}
SOAK_NODES = (*MODEL_NODES, PROFILER, *VAE_NODES, REPORT)


@dataclass(frozen=True)
class Link:
    """One node of a chain: its class and its widget inputs."""

    class_type: str
    inputs: dict

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.inputs.items() if k not in ("on_unavailable", "filename_prefix"))
        return f"{self.class_type.removeprefix('SDOpt')}({settings})"


@dataclass(frozen=True)
class SoakModel:
    """A checkpoint the prompts draw from: its generated LoRA (None: no LoRA) and, where its family's
    text encoder is a file of its own (sdopt's Flux), that file and the type ComfyUI's CLIPLoader loads
    it as."""

    lora: str | None = None
    text_encoder: str | None = None
    clip_type: str = "stable_diffusion"


@dataclass(frozen=True)
class SoakPrompt:
    """One prompt of a soak: the checkpoint, the chains, the image and sampler settings."""

    index: int
    checkpoint: str
    width: int
    height: int
    steps: int
    seed: int
    cfg: float
    sampler: str
    scheduler: str
    model_chain: tuple[Link, ...]
    vae_chain: tuple[Link, ...]
    report: bool
    model: SoakModel = SoakModel()  # what goes with the checkpoint: its text encoder file, if any, for CLIPLoader

    def nodes(self) -> set[str]:
        return {link.class_type for link in (*self.model_chain, *self.vae_chain)} | ({REPORT} if self.report else set())

    def describe(self) -> str:
        model = " > ".join(link.describe() for link in self.model_chain) or "stock"
        vae = " > ".join(link.describe() for link in self.vae_chain) or "stock"
        return (f"{self.checkpoint} {self.width}x{self.height} {self.steps} steps {self.sampler}/{self.scheduler} "
                f"cfg {self.cfg} seed {self.seed} | MODEL: {model} | VAE: {vae}" + (" | ProfileReport" if self.report else ""))

    def api_prompt(self) -> dict:
        """The prompt in ComfyUI's API format."""
        clip = ["clip", 0] if self.model.text_encoder else ["ckpt", 1]
        prompt = {
            "ckpt": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": self.checkpoint}},
            "positive": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse on a cliff at sunset", "clip": clip}},
            "negative": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry, watermark", "clip": clip}},
            "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": self.width, "height": self.height, "batch_size": 1}},
        }
        if self.model.text_encoder:
            prompt["clip"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": self.model.text_encoder, "type": self.model.clip_type}}
        model = ["ckpt", 0]
        for position, link in enumerate(self.model_chain):
            node_id = f"model{position}"
            prompt[node_id] = {"class_type": link.class_type, "inputs": {**link.inputs, "model": model}}
            model = [node_id, 0]
        vae = ["ckpt", 2]
        for position, link in enumerate(self.vae_chain):
            node_id = f"vae{position}"
            prompt[node_id] = {"class_type": link.class_type, "inputs": {**link.inputs, "vae": vae}}
            vae = [node_id, 0]
        prompt["sampler"] = {"class_type": "KSampler", "inputs": {
            "seed": self.seed, "steps": self.steps, "cfg": self.cfg, "sampler_name": self.sampler, "scheduler": self.scheduler,
            "denoise": 1.0, "model": model, "positive": ["positive", 0], "negative": ["negative", 0], "latent_image": ["latent", 0]}}
        prompt["decode"] = {"class_type": "VAEDecode", "inputs": {"samples": ["sampler", 0], "vae": vae}}
        prompt["save"] = {"class_type": "SaveImage", "inputs": {"images": ["decode", 0], "filename_prefix": f"sdopt-soak/{self.index:04d}"}}
        if self.report:
            prompt["report"] = {"class_type": REPORT, "inputs": {"filename_prefix": "sdopt-soak/report", "images": ["decode", 0]}}
        return prompt


def plan_prompt(index: int, seed: int, checkpoints: dict[str, SoakModel], warmup: int = DEFAULT_WARMUP) -> SoakPrompt:
    """Prompt ``index`` of the soak with ``seed``; ``checkpoints`` maps each checkpoint file to what
    goes with it; the first ``warmup`` prompts start with Compile in each of its modes. The same
    arguments always give the same prompt."""
    compile_mode = COMPILE_MODES_FIRST[index] if index < min(warmup, len(COMPILE_MODES_FIRST)) else None
    rng = random.Random(f"sdopt-soak {seed} {index}")
    forced = {name for position, name in enumerate(SOAK_NODES) if position % GROUPS == index % GROUPS}
    if compile_mode:
        forced.add(COMPILE)

    def drawn(names) -> list[str]:
        chosen = [name for name in names if name in forced or rng.random() < PROBABILITY]
        rng.shuffle(chosen)
        return chosen

    checkpoint = rng.choice(sorted(checkpoints))
    model_chain = [Link(name, MODEL_NODES[name](rng)) for name in drawn(MODEL_NODES)]
    if compile_mode:
        model_chain = [Link(link.class_type, {**link.inputs, "mode": compile_mode}) if link.class_type == COMPILE else link
                       for link in model_chain]
    model = checkpoints[checkpoint]
    lora = model.lora
    if lora and rng.random() < 0.5:
        model_chain.insert(rng.randint(0, len(model_chain)),
                           Link(LORA, {"lora_name": lora, "strength_model": rng.choice((0.5, 1.0))}))
    if PROFILER in forced or rng.random() < PROBABILITY:
        model_chain.append(Link(PROFILER, _profiler(rng)))
    vae_chain = [Link(name, VAE_NODES[name](rng)) for name in drawn(VAE_NODES)]
    report = REPORT in forced or rng.random() < PROBABILITY
    return SoakPrompt(index=index, checkpoint=checkpoint, width=rng.choice(SIDES), height=rng.choice(SIDES),
                      steps=rng.choice(STEPS), seed=rng.randrange(2**32), cfg=rng.choice((1.0, 4.0, 7.0)),
                      sampler=rng.choice(SAMPLERS), scheduler=rng.choice(SCHEDULERS), model_chain=tuple(model_chain),
                      vae_chain=tuple(vae_chain), report=report, model=model)


def probe_prompt(checkpoint: str, model: SoakModel = SoakModel()) -> dict:
    """The fixed prompt before each RSS reading: the checkpoint, no sdopt node, 64 px, 2 steps."""
    return SoakPrompt(index=0, checkpoint=checkpoint, width=64, height=64, steps=2, seed=0, cfg=7.0, sampler="euler",
                      scheduler="normal", model_chain=(), vae_chain=(), report=False, model=model).api_prompt()


# --- the verdict ----------------------------------------------------------------------------------


@dataclass
class PromptOutcome:
    """How one prompt ended: ``status`` is success, error (its history says so), rejected (the server
    refused the prompt) or timeout."""

    index: int
    chain: str
    status: str
    seconds: float
    error: str = ""
    rss_bytes: int | None = None  # the server's, right after the prompt: where the memory went, prompt by prompt

    @property
    def failed(self) -> bool:
        return self.status != SUCCESS


def drift(warm_bytes: int, end_bytes: int) -> float:
    """The RSS change from the warm reading to the end one, as a fraction of the warm one."""
    if warm_bytes <= 0:
        raise ValueError(f"warm RSS must be positive, got {warm_bytes}")
    return (end_bytes - warm_bytes) / warm_bytes


def problems(outcomes: list[PromptOutcome], memory_drift: float | None, max_drift: float) -> list[str]:
    """What fails the soak, one line each; empty when it passed."""
    found = [f"prompt {o.index} {o.status}: {o.error.splitlines()[0] if o.error else ''} [{o.chain}]".replace(":  [", " [")
             for o in outcomes if o.failed]
    if memory_drift is None:
        found.append("no RSS reading: the soak stopped before the end reading")
    elif memory_drift > max_drift:
        found.append(f"RSS drift {memory_drift:+.1%} is above the {max_drift:.1%} allowed")
    return found


def reading_points(prompts: int, warmup: int, every: int = READING_EVERY) -> list[int]:
    """How many prompts have run at each RSS reading: the warm-up's end, every ``every`` after it, the end."""
    return sorted({*range(warmup, prompts, every), prompts})


@dataclass
class SoakResult:
    seed: int
    prompts: int
    warmup: int
    outcomes: list[PromptOutcome] = field(default_factory=list)
    readings: list[tuple[int, int]] = field(default_factory=list)  # (prompts run, RSS bytes after the probe)
    max_drift: float = DEFAULT_MAX_DRIFT
    seconds: float = 0.0
    device: str = ""

    @property
    def failed(self) -> int:
        return sum(o.failed for o in self.outcomes)

    @property
    def _ends(self) -> int:
        return max(1, min(ENDS, len(self.readings) // 2))

    @property
    def _finished(self) -> bool:
        """Whether the end reading was taken: the drift needs it and one before it."""
        return len(self.readings) >= 2 and self.readings[-1][0] == self.prompts

    @property
    def rss_warm_bytes(self) -> int | None:
        """The median of the first readings; None before the end reading."""
        return int(statistics.median(rss for _, rss in self.readings[:self._ends])) if self._finished else None

    @property
    def rss_end_bytes(self) -> int | None:
        """The median of the last readings; None before the end reading."""
        return int(statistics.median(rss for _, rss in self.readings[-self._ends:])) if self._finished else None

    @property
    def drift(self) -> float | None:
        if self.rss_warm_bytes is None or self.rss_end_bytes is None:
            return None
        return drift(self.rss_warm_bytes, self.rss_end_bytes)

    def problems(self) -> list[str]:
        return problems(self.outcomes, self.drift, self.max_drift)

    def summary(self) -> str:
        mib = lambda value: "?" if value is None else f"{value / 2**20:,.0f} MiB"  # noqa: E731
        memory_drift = "?" if self.drift is None else f"{self.drift:+.2%}"
        ends = f"median of {self._ends} reading{'s' if self._ends > 1 else ''}"
        lines = [f"soak: {len(self.outcomes)}/{self.prompts} prompts run, {self.failed} failed, RSS {mib(self.rss_warm_bytes)} after "
                 f"{self.warmup} warm-up prompts, {mib(self.rss_end_bytes)} at the end ({ends} each; drift {memory_drift}, at most "
                 f"{self.max_drift:.1%} allowed), {self.seconds / 60:.1f} min, seed {self.seed}{f', {self.device}' if self.device else ''}"]
        if self.readings:
            lines.append("soak: RSS after the probe, by prompts run: "
                         + ", ".join(f"{count}: {rss / 2**20:,.0f} MiB" for count, rss in self.readings))
        found = self.problems()
        lines += [f"FAILED: {line}" for line in found] or ["passed"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"seed": self.seed, "prompts": self.prompts, "warmup": self.warmup, "run": len(self.outcomes), "failed": self.failed,
                "rss_warm_bytes": self.rss_warm_bytes, "rss_end_bytes": self.rss_end_bytes, "drift": self.drift,
                "readings": [{"prompts_run": count, "rss_bytes": rss} for count, rss in self.readings],
                "max_drift": self.max_drift, "minutes": self.seconds / 60, "device": self.device, "passed": not self.problems(),
                "problems": self.problems(), "outcomes": [asdict(o) for o in self.outcomes]}


# --- the server ----------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


class Client:
    """ComfyUI's HTTP API, the calls a soak makes."""

    def __init__(self, url: str):
        self.url = url

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def queue(self, prompt: dict) -> str:
        """The prompt id; a refused prompt raises ``Rejected`` with the server's reasons."""
        try:
            with self._post("/prompt", {"prompt": prompt, "client_id": CLIENT_ID}) as response:
                return json.load(response)["prompt_id"]
        except urllib.error.HTTPError as error:
            raise Rejected(_rejection(error.read().decode(errors="replace"))) from None

    def collect_garbage(self) -> None:
        """Ask the server to unload its models and collect garbage (``POST /free``); the outputs it
        cached are kept."""
        with self._post("/free", {"unload_models": True}):
            pass

    def _post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=30)

    def wait(self, prompt_id: str, timeout: float) -> dict | None:
        """The prompt's history entry once it has ended; None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry:  # ComfyUI files a prompt in its history when it ends, with an error or not
                return entry
            time.sleep(0.2)
        return None


class Rejected(Exception):
    """The server refused a prompt (validation)."""


def _rejection(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:500]
    parts = [data.get("error", {}).get("message", "")] if isinstance(data.get("error"), dict) else [str(data.get("error", ""))]
    for node_id, errors in (data.get("node_errors") or {}).items():
        for error in errors.get("errors", []):
            parts.append(f"node {node_id} {errors.get('class_type', '')}: {error.get('message', '')}: {error.get('details', '')}")
    return "; ".join(filter(None, parts))


def history_error(entry: dict) -> str:
    """The error of a failed prompt's history entry: node, exception and its message, then the traceback."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            where = f"node {data.get('node_id')} {data.get('node_type')}"
            trace = "".join(data.get("traceback") or [])
            return f"{where}: {data.get('exception_type')}: {data.get('exception_message', '').strip()}\n{trace}".rstrip()
        if kind == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')} {data.get('node_type')}"
    return "the history says the prompt failed, with no error message"


def run_one(client: Client, prompt: dict, timeout: float) -> tuple[str, float, str]:
    """(status, seconds, error) of one prompt run to its end."""
    start = time.monotonic()
    try:
        prompt_id = client.queue(prompt)
    except Rejected as error:
        return "rejected", time.monotonic() - start, str(error)
    entry = client.wait(prompt_id, timeout)
    seconds = time.monotonic() - start
    if entry is None:
        return "timeout", seconds, f"no end within {timeout:.0f} s"
    if entry["status"].get("status_str") != SUCCESS:
        return "error", seconds, history_error(entry)
    return SUCCESS, seconds, ""


def soak(comfyui: Path | None, models: Path | None = None, *, prompts: int = DEFAULT_PROMPTS, seed: int = 0,
         port: int | None = None, max_drift: float = DEFAULT_MAX_DRIFT, warmup: int = DEFAULT_WARMUP,
         model_names: tuple[str, ...] = ("mini",), lora: bool = True, prompt_timeout: float = PROMPT_TIMEOUT_S,
         log: Callable[[str], None] = lambda line: print(line, flush=True)) -> SoakResult:
    """Run the soak (see the module docstring); ``log`` gets its status lines, stdout one line per prompt."""
    from .bench_unet import checkpoint_path
    from .modelgen import text_encoder_path, write_lora
    from .serve import LINK_NAME, _comfyui_root, free_port, install_pack, serve, stop, wait_ready

    if prompts < 1:
        raise UserError(f"--prompts {prompts}: run at least 1 prompt")
    warmup = max(0, min(warmup, prompts - 1))  # the warm reading comes before the last prompt at the latest
    if max_drift < 0:
        raise UserError(f"--max-drift {max_drift * 100:g}: give a percentage at or above 0, e.g. 5 for 5%")
    root = _comfyui_root(comfyui)
    models = Path(models) if models is not None else root / "models"
    result = SoakResult(seed=seed, prompts=prompts, warmup=warmup, max_drift=max_drift)
    link = root / "custom_nodes" / LINK_NAME
    linked_here = not (link.is_symlink() or link.exists())
    with tempfile.TemporaryDirectory(prefix="sdopt-soak-") as scratch:
        scratch = Path(scratch)
        checkpoints: dict[str, SoakModel] = {}
        loras = scratch / "loras"
        for name in model_names:
            family, size = resolve_model(name)
            path = checkpoint_path(name, models)
            if path.parent.resolve() != (models / "checkpoints").resolve():
                raise UserError(f"--model {name}: the checkpoint must be in {models / 'checkpoints'}, the folder ComfyUI is offered")
            checkpoints[path.name] = SoakModel(
                write_lora(name, loras / f"sdopt-soak-{name}-lora.safetensors").path.name if lora else None,
                text_encoder_path(path).name if family.text_encoder_filename(size) else None, family.clip_type)
        lora_config = scratch / "loras.yaml"
        lora_config.write_text(f"sdopt_soak:\n  loras: {json.dumps(str(loras))}\n")
        (scratch / "output").mkdir()
        (scratch / "user").mkdir()
        port = port or free_port()
        args = ["--output-directory", str(scratch / "output"), "--user-directory", str(scratch / "user"),
                "--input-directory", str(scratch / "input"), "--temp-directory", str(scratch),
                "--database-url", "sqlite:///:memory:", "--extra-model-paths-config", str(lora_config)]
        server_log = scratch / "server.log"
        install_pack(root)
        start = time.monotonic()
        with server_log.open("w") as log_file:
            process = serve(root, models, port, extra_args=args, config_dir=scratch, stdout=log_file, stderr=subprocess.STDOUT,
                            env=_server_env(scratch), die_with_parent=True)
        try:
            client = Client(f"http://127.0.0.1:{port}")
            try:
                wait_ready(client.url + f"/object_info/{REPORT}", process, timeout=300)
            except RuntimeError as error:
                raise UserError(f"{error}; the server's log ends:\n{_tail(server_log)}") from None
            if REPORT not in client.get(f"/object_info/{REPORT}"):
                raise UserError(f"the server runs but did not load sdopt; its log ends:\n{_tail(server_log)}")
            result.device = _device(client)
            log(f"soak: ComfyUI at {client.url} ({result.device}), {prompts} prompts, seed {seed}, RSS read after "
                f"{warmup} warm-up prompts, every {READING_EVERY} after them and at the end")
            first = sorted(checkpoints)[0]
            probe = probe_prompt(first, checkpoints[first])
            _run_prompts(client, process, result, checkpoints, probe, prompt_timeout, log)
        finally:
            result.seconds = time.monotonic() - start
            stop(process)
            if linked_here and link.is_symlink():
                link.unlink()  # leave the ComfyUI tree as it was
            if any(o.failed for o in result.outcomes):
                log(f"soak: the server's log ends:\n{_tail(server_log)}")
    return result


def _run_prompts(client: Client, process, result: SoakResult, checkpoints: dict, probe: dict, timeout: float, log) -> None:
    points = reading_points(result.prompts, result.warmup)

    def run_probe(count: int) -> None:
        status, seconds, error = run_one(client, probe, timeout)
        if status != SUCCESS:
            raise UserError(f"the probe prompt (no sdopt node) before the RSS reading after {count} prompts {status}: {error}")

    def read_rss(count: int) -> None:
        run_probe(count)
        client.collect_garbage()
        # The probe twice more, every output cached, so nothing runs: ComfyUI's worker acts on /free
        # before it takes the next prompt, or at the latest after that prompt has ended (should that
        # prompt have been queued before the worker woke), so the second ends after the collection.
        run_probe(count)
        run_probe(count)
        result.readings.append((count, rss_bytes(process.pid)))

    with progress_bar(total=result.prompts, desc="soak", unit="prompt", disable=not sys.stderr.isatty()) as bar:
        for index in range(result.prompts):
            if index in points:
                read_rss(index)
                if index == result.warmup:
                    log(f"soak: RSS {result.readings[-1][1] / 2**20:,.0f} MiB after {index} warm-up prompts")
            planned = plan_prompt(index, result.seed, checkpoints, result.warmup)
            status, seconds, error = run_one(client, planned.api_prompt(), timeout)
            alive = process.poll() is None
            outcome = PromptOutcome(index, planned.describe(), status, seconds, error, rss_bytes(process.pid) if alive else None)
            result.outcomes.append(outcome)
            rss = f", RSS {outcome.rss_bytes / 2**20:,.0f} MiB" if alive else ""
            bar.write(f"prompt {index + 1}/{result.prompts} {status} {seconds:.1f} s{rss}: {outcome.chain}"
                      + (f"\n  {error}" if error else ""))
            sys.stdout.flush()  # a log shows each prompt as it ends
            bar.update()
            if not alive:
                log(f"soak: the server exited with status {process.returncode} after prompt {index + 1}")
                return
    read_rss(result.prompts)


# glibc's mmap threshold held at its initial 128 KiB: glibc otherwise raises it with each large block
# freed (up to 32 MiB), after which freed tensors stay in the heap, and a reading after the stock probe
# prompt (which runs no sdopt heap trim) counts hundreds of MiB of free heap that wander with what ran
# before it (docs/benchmarks.md, Soak). Held, a freed tensor's pages go back at once and RSS follows the
# live memory, which is what a leak grows. A value the caller set is kept; other C libraries ignore it.
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _server_env(scratch: Path) -> dict:
    import os

    # Compile's disk cache in the scratch folder: a soak neither reads nor grows the user's cache.
    return {**MMAP_THRESHOLD, **os.environ, "SDOPT_CACHE_DIR": str(scratch / "compile-cache")}


def _device(client: Client) -> str:
    try:
        devices = client.get("/system_stats").get("devices", [])
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    return ", ".join(device.get("name", "?") for device in devices)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def write_json(result: SoakResult, path: Path, command: str) -> None:
    path.write_text(json.dumps({"command": command, **result.to_dict()}, indent=2))
