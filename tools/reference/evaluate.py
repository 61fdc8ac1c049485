"""Sampling a reference model through ComfyUI's own nodes and reading its images back: which captions it
draws, as the attribute classifier reads them (prompt accuracy).

Runs inside a booted ComfyUI (``tools/headless``): the model, CLIP and VAE are what CheckpointLoaderSimple
gives (or any patched clone of that MODEL), each image is CLIPTextEncode -> KSampler -> VAEDecode, as in a
workflow.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .classifier import load_classifier, prompt_accuracy, read_scenes
from .scenes import Scene, all_scenes


@dataclass(frozen=True)
class Sampling:
    """How the reference images are sampled: the defaults are the reference models' default settings."""

    steps: int = 20
    sampler: str = "euler"
    scheduler: str = "normal"
    cfg: float = 5.0
    size: int = 64


def evaluation_set(count: int, offset: int = 0) -> list[tuple[Scene, int]]:
    """``count`` (scene, noise seed) pairs spread evenly over the dataset's captions, seed i for the i-th;
    the same count always gives the same pairs."""
    scenes = all_scenes()
    stride = len(scenes) / count
    return [(scenes[int(offset + index * stride) % len(scenes)], index) for index in range(count)]


def sample_images(model, clip, vae, pairs: list[tuple[Scene, int]], sampling: Sampling = Sampling()) -> torch.Tensor:
    """ComfyUI's images ``[N, H, W, 3]`` of each (scene, seed): its caption as the positive prompt, the empty
    prompt as the negative."""
    import nodes

    # As ComfyUI's executor runs every node: no autograd graph is built.
    with torch.inference_mode():
        return _sample_images(nodes, model, clip, vae, pairs, sampling)


def _sample_images(nodes, model, clip, vae, pairs, sampling: Sampling) -> torch.Tensor:
    encode = nodes.CLIPTextEncode().encode
    negative = encode(clip, "")[0]
    latents = []
    for scene, seed in pairs:
        latent = nodes.EmptyLatentImage().generate(sampling.size, sampling.size, 1)[0]
        latents.append(nodes.common_ksampler(model, seed, sampling.steps, sampling.cfg, sampling.sampler, sampling.scheduler,
                                             encode(clip, scene.caption)[0], negative, latent)[0]["samples"])
    # One VAEDecode of the whole batch, as a workflow's batch is decoded: the same images, in a fraction of the time.
    return nodes.VAEDecode().decode(vae, {"samples": torch.cat(latents)})[0]


def caption_accuracy(images: torch.Tensor, pairs: list[tuple[Scene, int]]) -> dict[str, float]:
    """The classifier's reading of ``images`` against the scenes they were asked for (``prompt_accuracy``)."""
    return prompt_accuracy(read_scenes(load_classifier(), images), [scene for scene, _ in pairs])
