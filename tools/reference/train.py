"""Training a reference model's diffusion model on the scenes, through ComfyUI's own modules.

The model is the one ComfyUI builds from the reference checkpoint (``make-model``'s layout, random
weights from seed 0), conditioned on each caption as ComfyUI's CLIPTextEncode encodes it with the
checkpoint's own text encoder, and trained on the latents the block-mean VAE gives the scenes, with the
family's own noise schedule and prediction, through ComfyUI's ``apply_model`` (SD1.5: DDPM's epsilon; SD3:
rectified flow's velocity at its shifted sigmas), so KSampler samples it as it samples the family. A tenth
of the captions are dropped to the empty prompt, so classifier-free guidance works. What is shipped is the weights' exponential moving average, stored as ``modelgen.trained`` stores it.
"""
from __future__ import annotations

import contextlib
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...families import checkpoint_config, resolve_model
from ..modelgen.block_mean_vae import block_mean_latent
from ..modelgen.checkpoint import checkpoint_specs
from ..modelgen.files import write_safetensors
from ..modelgen.trained import file_sha256, save_trained, weights_path
from ..progress import progress_bar
from .classifier import renders
from .scenes import all_scenes

# Modules the LDM initialises to zero (its zero_module): each residual branch's last conv, each
# transformer's output projection, the model's output conv. A new branch then starts as the identity.
_ZERO_INIT = (".out_layers.3.", ".proj_out.", "out.2.")
# Renders per scene in the training pool: the scenes' jitter has four placements.
_RENDERS_PER_SCENE = 4


@dataclass(frozen=True)
class TrainingConfig:
    """One reference model's training run; the defaults are what the shipped weights were trained with."""

    steps: int
    batch: int = 16
    learning_rate: float = 4e-4
    warmup_steps: int = 50
    # The share of each batch trained on the empty prompt (classifier-free guidance's unconditional branch).
    uncond_share: float = 0.1
    ema_decay: float = 0.995
    # Min-SNR-gamma loss weighting (Hang et al., 2023): no noise level dominates, so training converges fast.
    min_snr_gamma: float = 5.0
    seed: int = 0


# What each reference model's shipped weights were trained with: as many steps as fit 30 minutes on
# 2 CPU cores, set-up (writing and loading the untrained checkpoint, encoding the captions) included.
TRAINING = {"ref-sd15": TrainingConfig(steps=2400), "ref-sd35": TrainingConfig(steps=4000)}


@dataclass
class TrainingResult:
    model: str
    weights: Path
    sha256: str
    seconds: float
    losses: list[float]
    config: TrainingConfig


def _ema_losses(losses: list[float], decay: float = 0.98) -> list[float]:
    smoothed, value = [], losses[0] if losses else 0.0
    for loss in losses:
        value = decay * value + (1 - decay) * loss
        smoothed.append(value)
    return smoothed


def plot_losses(result: TrainingResult, path: Path) -> Path:
    """The loss curve (per step, and smoothed) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.plot(result.losses, color="#bbb", linewidth=0.6, label="per step")
    axes.plot(_ema_losses(result.losses), color="#1f5fa8", label="smoothed")
    axes.set(xlabel="step", ylabel="min-SNR-weighted MSE of the model output", yscale="log",
             title=f"{result.model}: {result.config.steps} steps of {result.config.batch}, {result.seconds / 60:.1f} min")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _training_pool(model: str):
    """The scenes, and per scene ``_RENDERS_PER_SCENE`` latents (model space) of renders with seeds 0..3."""
    family, _ = resolve_model(model)
    scenes = all_scenes()
    pairs = [(scene, seed) for scene in scenes for seed in range(_RENDERS_PER_SCENE)]
    images = renders([scene for scene, _ in pairs], [seed for _, seed in pairs])
    latents = block_mean_latent(images.movedim(1, -1), family.latent)
    return scenes, latents.reshape(len(scenes), _RENDERS_PER_SCENE, *latents.shape[1:])


def _load_untrained(model: str):
    """ComfyUI's MODEL and CLIP for ``model`` with a random (seed 0) diffusion model: its checkpoint
    written without the shipped weights, to a temporary file."""
    import comfy.sd

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "untrained.safetensors"
        write_safetensors(checkpoint_specs(model), path, {"format": "pt"}, seed=0, dtype="fp32",
                          desc=f"{model} (untrained)", progress=False)
        model_patcher, clip, _, _ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False)
    return model_patcher, clip


@contextlib.contextmanager
def _sdpa_attention():
    """ComfyUI's UNet attention as PyTorch's SDPA while training: on a CPU ComfyUI picks its sub-quadratic
    kernel, the same maths 15% slower forward and backward here."""
    import comfy.ldm.modules.attention as attention

    chosen = attention.optimized_attention
    attention.optimized_attention = getattr(attention, "attention_pytorch", chosen)
    try:
        yield
    finally:
        attention.optimized_attention = chosen


def _conditions(clip, captions: list[str], pooled: bool, chunk: int = 48) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each caption's cross-attention context as CLIPTextEncode gives it, ``[len, tokens, width]``, and,
    for a model that takes one, its pooled text ``[len, width]`` (None otherwise).

    Without pooled text, captions go to ComfyUI as the 77-token sections of one long prompt, which it
    encodes as one batch, each section as on its own, and joins along the tokens; a long prompt keeps only
    its first section's pooled text, so with pooled text each caption is encoded alone."""
    contexts, pools = [], []
    if pooled:
        for caption in progress_bar(captions, desc="encoding captions", unit="captions"):
            context, pool = clip.encode_from_tokens(clip.tokenize(caption), return_pooled=True)
            contexts.append(context.float())
            pools.append(pool.float())
        return torch.cat(contexts), torch.cat(pools)
    for start in progress_bar(range(0, len(captions), chunk), desc="encoding captions", unit="batches"):
        tokens: dict[str, list] = {}
        for caption in captions[start:start + chunk]:
            for encoder, sections in clip.tokenize(caption).items():
                tokens.setdefault(encoder, []).extend(sections)
        joined = clip.encode_from_tokens(tokens).float()
        contexts.append(joined.reshape(-1, joined.shape[1] // len(captions[start:start + chunk]), joined.shape[2]))
    return torch.cat(contexts), None


def _model_inputs(base, contexts: torch.Tensor, pooled: torch.Tensor | None, x0: torch.Tensor) -> dict:
    """The keyword inputs of ``apply_model`` for a batch, built by the model's own ``extra_conds`` as
    ComfyUI's samplers build them (SD3's ``y`` from the pooled text, SD1.5's context alone)."""
    extra = {} if pooled is None else {"pooled_output": pooled}
    conds = base.extra_conds(cross_attn=contexts, noise=x0, device=x0.device, width=x0.shape[-1] * 8,
                             height=x0.shape[-2] * 8, **extra)
    return {key: cond.cond for key, cond in conds.items()}


def _signal_to_noise(model_sampling, sigmas: torch.Tensor) -> torch.Tensor:
    """(a / b)**2 where the diffusion model sees ``a * x0 + b * noise`` at each sigma: the model
    sampling's own noise scaling and input scaling (DDPM's 1/sigma**2, rectified flow's ((1-s)/s)**2)."""
    shape = (len(sigmas), 1, 1, 1)
    sigma, one, zero = sigmas.view(shape), torch.ones(shape), torch.zeros(shape)
    signal = model_sampling.calculate_input(sigmas, model_sampling.noise_scaling(sigma, zero, one))
    noise = model_sampling.calculate_input(sigmas, model_sampling.noise_scaling(sigma, one, zero))
    return (signal / noise).flatten() ** 2


def train_reference(model: str, config: TrainingConfig | None = None, *, weights: Path | None = None) -> TrainingResult:
    """Train reference model ``model``'s diffusion model (``TRAINING[model]`` unless ``config``) and store it
    (default: the shipped file)."""
    if not checkpoint_config(model).trained:
        raise ValueError(f"{model} is not a reference model")
    config = config or TRAINING[model]
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    model_patcher, clip = _load_untrained(model)
    scenes, latents = _training_pool(model)
    family, _ = resolve_model(model)
    contexts, pools = _conditions(clip, [scene.caption for scene in scenes] + [""], pooled=family.call.vector is not None)
    uncond = len(scenes)
    del clip

    base = model_patcher.model
    network = base.diffusion_model.float().train()
    with torch.no_grad():
        for name, parameter in network.named_parameters():
            if any(part in f".{name}" for part in _ZERO_INIT):
                parameter.zero_()
    for parameter in network.parameters():
        parameter.requires_grad_(True)
    ema = {name: parameter.detach().clone() for name, parameter in network.named_parameters()}
    # The noise levels ComfyUI samples over (its 1000 discrete steps, shifted where the family shifts them).
    sigmas = base.model_sampling.sigmas.float()
    snr = _signal_to_noise(base.model_sampling, sigmas)
    optimizer = torch.optim.AdamW(network.parameters(), lr=config.learning_rate, weight_decay=0.01)

    def learning_rate(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate)
    losses: list[float] = []
    smoothed = None
    bar = progress_bar(total=config.steps, desc=f"training {model}", unit="steps")
    with _sdpa_attention():
        for step in range(config.steps):
            picks = [rng.randrange(len(scenes)) for _ in range(config.batch)]
            x0 = torch.stack([latents[pick, rng.randrange(_RENDERS_PER_SCENE)] for pick in picks])
            texts = [uncond if rng.random() < config.uncond_share else pick for pick in picks]
            inputs = _model_inputs(base, contexts[texts], None if pools is None else pools[texts], x0)
            t = torch.randint(0, len(sigmas), (config.batch,))
            sigma = sigmas[t]
            noisy = base.model_sampling.noise_scaling(sigma.view(-1, 1, 1, 1), torch.randn_like(x0), x0)
            denoised = base.apply_model(noisy, sigma, **inputs)
            # The model's own output error, (denoised - x0) / sigma (SD1.5's epsilon, rectified flow's
            # velocity), weighted by min(SNR, gamma) / SNR written as min(1, gamma / SNR): rectified flow's
            # last sigma has an SNR of 0.
            error = ((denoised - x0) / sigma.view(-1, 1, 1, 1)).square().mean(dim=(1, 2, 3))
            loss = (torch.clamp(config.min_snr_gamma / snr[t], max=1.0) * error).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            decay = min(config.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                for name, parameter in network.named_parameters():
                    ema[name].lerp_(parameter.detach(), 1 - decay)
            losses.append(loss.item())
            smoothed = losses[-1] if smoothed is None else 0.98 * smoothed + 0.02 * losses[-1]
            bar.set_postfix(loss=f"{smoothed:.4f}", refresh=False)
            bar.update(1)
    bar.close()
    seconds = time.perf_counter() - start
    state = {name: ema.get(name, tensor) for name, tensor in network.state_dict().items()}
    path = save_trained(model, state, weights or weights_path(model))
    return TrainingResult(model, path, file_sha256(path), seconds, losses, config)


def describe(result: TrainingResult) -> str:
    settings = ", ".join(f"{key}={value}" for key, value in asdict(result.config).items())
    return (f"trained {result.model} in {result.seconds / 60:.1f} min ({settings}); final smoothed loss "
            f"{_ema_losses(result.losses)[-1]:.4f}; wrote {result.weights} (sha256 {result.sha256})")
