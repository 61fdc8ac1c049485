"""A soak's prompts: each a random chain drawn from the seed and its index, in ComfyUI's API format, and
the fixed probe prompt run before each memory reading."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .drawn_nodes import COMPILE, COMPILE_MODES_FIRST, PROFILER, REPORT, SETTINGS, soak_nodes

# Read after every prompt, seed 0's SD1.5 soak (docs/benchmarks-log.md, Soak) climbs about 160 MiB over its first
# 30 prompts, in steps at prompts that trace or compile a mix of weight dtype and memory format not met
# before (torch's one-time set-up for it), then wanders within 100 MiB: the warm-up covers the steps.
DEFAULT_WARMUP = 35
SIDES = (64, 96, 128)
STEPS = (2,)
SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m")
SCHEDULERS = ("normal", "karras")
# Any this many consecutive prompts force every node in at least once (node j into prompts k with k % GROUPS == j % GROUPS).
GROUPS = 5
PROBABILITY = 0.4  # of a node not forced in
LORA = "LoraLoaderModelOnly"


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
    arguments always give the same prompt (for the same registered nodes: ``drawn_nodes``)."""
    nodes = soak_nodes()
    compile_mode = COMPILE_MODES_FIRST[index] if index < min(warmup, len(COMPILE_MODES_FIRST)) else None
    rng = random.Random(f"sdopt-soak {seed} {index}")
    forced = {name for position, name in enumerate(nodes.all) if position % GROUPS == index % GROUPS}
    if compile_mode:
        forced.add(COMPILE)

    def drawn(names) -> list[str]:
        chosen = [name for name in names if name in forced or rng.random() < PROBABILITY]
        rng.shuffle(chosen)
        return chosen

    checkpoint = rng.choice(sorted(checkpoints))
    model_chain = [Link(name, SETTINGS[name](rng)) for name in drawn(nodes.model)]
    if compile_mode:
        model_chain = [Link(link.class_type, {**link.inputs, "mode": compile_mode}) if link.class_type == COMPILE else link
                       for link in model_chain]
    model = checkpoints[checkpoint]
    lora = model.lora
    if lora and rng.random() < 0.5:
        model_chain.insert(rng.randint(0, len(model_chain)),
                           Link(LORA, {"lora_name": lora, "strength_model": rng.choice((0.5, 1.0))}))
    if PROFILER in forced or rng.random() < PROBABILITY:
        model_chain.append(Link(PROFILER, SETTINGS[PROFILER](rng)))
    vae_chain = [Link(name, SETTINGS[name](rng)) for name in drawn(nodes.vae)]
    report = REPORT in forced or rng.random() < PROBABILITY
    return SoakPrompt(index=index, checkpoint=checkpoint, width=rng.choice(SIDES), height=rng.choice(SIDES),
                      steps=rng.choice(STEPS), seed=rng.randrange(2**32), cfg=rng.choice((1.0, 4.0, 7.0)),
                      sampler=rng.choice(SAMPLERS), scheduler=rng.choice(SCHEDULERS), model_chain=tuple(model_chain),
                      vae_chain=tuple(vae_chain), report=report, model=model)


def probe_prompt(checkpoint: str, model: SoakModel = SoakModel()) -> dict:
    """The fixed prompt before each RSS reading: the checkpoint, no sdopt node, 64 px, 2 steps."""
    return SoakPrompt(index=0, checkpoint=checkpoint, width=64, height=64, steps=2, seed=0, cfg=7.0, sampler="euler",
                      scheduler="normal", model_chain=(), vae_chain=(), report=False, model=model).api_prompt()
