"""The attribute classifier: reads a ``scenes`` image back into its scene (shape, colour, background,
position, size), to score how well a generated image follows its caption.

A small CNN on the 8x8 grid that every scene is drawn on (the input is average-pooled to it first), trained
on renders of every scene with augmentations standing in for a diffusion model's imperfections: noise,
colour shifts, blur and cells bleeding into their neighbours. The trained weights ship in ``weights/`` and
``WEIGHTS_SHA256`` pins them.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ...errors import UserError
from ..modelgen.trained import file_sha256
from ..progress import progress_bar
from .scenes import COLOURS, GRID, POSITIONS, SHAPES, SIZES, Scene, all_scenes, render

ATTRIBUTES = {"shape": SHAPES, "colour": tuple(COLOURS), "background": tuple(COLOURS), "position": POSITIONS,
              "size": SIZES}
WEIGHTS = Path(__file__).with_name("weights") / "classifier.safetensors"
# The shipped file's sha256: a retrain that changes the weights pins the new file here.
WEIGHTS_SHA256 = "e7b3e1d47b2a48ddd5cbec7c7ef978c84b051c1e607fb45e3422134e44fcd835"
RETRAIN = "python -m sdopt train-reference classifier"

# Training renders use seeds below TRAIN_SEEDS; held-out renders start far above them.
TRAIN_SEEDS = 8
HELD_OUT_SEED = 1_000_000
# The held-out "noisy" score: gaussian noise on every pixel, and on every cell (which pooling keeps).
NOISY_PIXEL_STD = 0.1
NOISY_CELL_STD = 0.05


class AttributeClassifier(nn.Module):
    """Images ``[B, 3, H, W]`` in [0, 1] (64x64 is what scenes are; other sizes are average-pooled to the
    same 8x8 grid) to a dict of logits ``[B, classes]``, one entry per attribute of ``ATTRIBUTES``."""

    def __init__(self, width: int = 32, hidden: int = 96):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
        )
        # A dense layer over the 4x4 map rather than global pooling: position is where the shape is.
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * (GRID // 2) ** 2, hidden), nn.ReLU())
        self.heads = nn.ModuleDict({name: nn.Linear(hidden, len(classes)) for name, classes in ATTRIBUTES.items()})

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        cells = F.adaptive_avg_pool2d(images, GRID)
        hidden = self.trunk(self.features(cells * 2 - 1))
        return {name: head(hidden) for name, head in self.heads.items()}


def renders(scenes: list[Scene], seeds: list[int]) -> torch.Tensor:
    """The renders of (scene, seed) pairs as ``[N, 3, 64, 64]`` floats in [0, 1]."""
    images = [render(scene, seed) for scene, seed in zip(scenes, seeds)]
    width, height = images[0].size
    pixels = torch.frombuffer(bytearray(b"".join(image.tobytes() for image in images)), dtype=torch.uint8)
    return pixels.view(len(images), height, width, 3).permute(0, 3, 1, 2).float() / 255


def _labels(scenes: list[Scene]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor([classes.index(getattr(scene, name)) for scene in scenes])
            for name, classes in ATTRIBUTES.items()}


def _shifted(cells: torch.Tensor, direction: int) -> torch.Tensor:
    """The grid moved one cell (0: right, 1: left, 2: down, 3: up), the edge cells repeated."""
    padded = F.pad(cells, (1, 1, 1, 1), mode="replicate")
    rows, columns = [(1, 0), (1, 2), (0, 1), (2, 1)][direction]
    return padded[..., rows:rows + cells.shape[-2], columns:columns + cells.shape[-1]]


def augment(cells: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What a diffusion model's output may look like next to a clean render, drawn per image at random
    strength (some near none): cells bled into a neighbour, the whole image off the grid by part of a
    cell, blur, a colour cast, and noise on every cell."""
    batch = cells.shape[0]

    def uniform(high: float, *shape: int) -> torch.Tensor:
        return torch.rand(batch, *shape, generator=generator) * high

    direction = int(torch.randint(4, (), generator=generator))
    bleeding = (uniform(1, 1, GRID, GRID) < uniform(0.25, 1, 1, 1)).float() * uniform(0.5, 1, GRID, GRID)
    cells = cells + bleeding * (_shifted(cells, direction) - cells)
    offset = uniform(0.35, 1, 1, 1) * (uniform(1, 1, 1, 1) < 0.3)
    cells = cells + offset * (_shifted(cells, (direction + 2) % 4) - cells)
    blurred = F.avg_pool2d(F.pad(cells, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    cells = cells + uniform(0.6, 1, 1, 1) * (uniform(1, 1, 1, 1) < 0.3) * (blurred - cells)
    gain = 1 + torch.randn(batch, 3, 1, 1, generator=generator) * 0.06
    cast = torch.randn(batch, 3, 1, 1, generator=generator) * 0.05
    cells = cells * gain + cast
    cells = cells + torch.randn(cells.shape, generator=generator) * uniform(0.12, 1, 1, 1)
    return cells.clamp(0, 1)


def noisy(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Held-out renders with moderate noise: ``NOISY_PIXEL_STD`` on every pixel, ``NOISY_CELL_STD`` on
    every 8x8 cell."""
    cell_noise = torch.randn(images.shape[0], 3, GRID, GRID, generator=generator) * NOISY_CELL_STD
    pixel_noise = torch.randn(images.shape, generator=generator) * NOISY_PIXEL_STD
    return (images + pixel_noise + F.interpolate(cell_noise, size=images.shape[-2:], mode="nearest")).clamp(0, 1)


def held_out(count: int | None = None) -> tuple[list[Scene], torch.Tensor]:
    """``count`` scenes spread over the dataset (all 720 by default) and their renders with seeds from
    ``HELD_OUT_SEED``, never used in training."""
    scenes = list(all_scenes())
    if count is not None:
        scenes = scenes[::max(1, len(scenes) // count)][:count]
    return scenes, renders(scenes, [HELD_OUT_SEED + index for index in range(len(scenes))])


def train_classifier(path: Path | str = WEIGHTS, *, steps: int = 2000, batch: int = 128, seed: int = 0,
                     progress: bool = True) -> dict:
    """Train the classifier, write its fp16 weights to ``path`` and return its held-out accuracy
    (``prompt_accuracy``), on clean renders and on ``noisy`` ones, read with the fp16 weights written."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    scenes = [scene for scene in all_scenes() for _ in range(TRAIN_SEEDS)]
    cells = F.adaptive_avg_pool2d(renders(scenes, list(range(TRAIN_SEEDS)) * len(all_scenes())), GRID)
    labels = _labels(scenes)
    model = AttributeClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    started = time.perf_counter()
    with progress_bar(total=steps, desc="classifier", unit="steps", disable=not progress) as bar:
        for _ in range(steps):
            chosen = torch.randint(len(scenes), (batch,), generator=generator)
            logits = model(augment(cells[chosen], generator))
            loss = sum(F.cross_entropy(logits[name], labels[name][chosen]) for name in ATTRIBUTES)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update()
    seconds = time.perf_counter() - started
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({name: tensor.detach().half().contiguous() for name, tensor in model.state_dict().items()}, str(partial))
    os.replace(partial, path)
    classifier = load_classifier(path)
    wanted, images = held_out()
    return {"clean": prompt_accuracy(read_scenes(classifier, images), wanted),
            "noisy": prompt_accuracy(read_scenes(classifier, noisy(images, generator)), wanted),
            "train_seconds": seconds, "sha256": weights_sha256(path)}


def weights_sha256(path: Path | str = WEIGHTS) -> str:
    return file_sha256(Path(path))


def load_classifier(path: Path | str = WEIGHTS) -> AttributeClassifier:
    """The trained classifier in fp32, in eval mode; a UserError naming the retrain command where the
    weights are missing."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no classifier weights at {path}: train them with `{RETRAIN}`")
    classifier = AttributeClassifier()
    classifier.load_state_dict({name: tensor.float() for name, tensor in load_file(str(path)).items()})
    return classifier.eval()


def read_scenes(classifier: AttributeClassifier, images: torch.Tensor) -> list[Scene]:
    """The scene the classifier reads in each image of a batch in [0, 1]: ``[B, 3, H, W]`` (channels
    first, torch's layout) or ComfyUI's IMAGE ``[B, H, W, 3]`` (channels last). The layout is told by
    where the size-3 dimension is: dimension 1 means channels first, else the last dimension means
    channels last (an image 3 pixels high would be taken as channels first)."""
    if images.dim() != 4 or 3 not in (images.shape[1], images.shape[-1]):
        raise ValueError(f"expected images [B, 3, H, W] or [B, H, W, 3], got shape {tuple(images.shape)}")
    if images.shape[1] != 3:
        images = images.permute(0, 3, 1, 2)
    parameter = next(classifier.parameters())
    with torch.no_grad():
        logits = classifier(images.to(parameter.device, parameter.dtype))
    picks = {name: logits[name].argmax(-1).tolist() for name in ATTRIBUTES}
    return [Scene(**{name: ATTRIBUTES[name][picks[name][index]] for name in ATTRIBUTES})
            for index in range(images.shape[0])]


def prompt_accuracy(read: list[Scene], wanted: list[Scene]) -> dict[str, float]:
    """The share of images read as wanted: ``shape_colour`` (shape and colour both right, the headline),
    ``all`` (every attribute right), and each attribute on its own."""
    if len(read) != len(wanted) or not wanted:
        raise ValueError(f"need as many scenes read as wanted, at least one: got {len(read)} and {len(wanted)}")

    def share(right) -> float:
        return sum(1 for got, want in zip(read, wanted) if right(got, want)) / len(wanted)

    accuracy = {"shape_colour": share(lambda got, want: (got.shape, got.colour) == (want.shape, want.colour)),
                "all": share(lambda got, want: got == want)}
    for name in ATTRIBUTES:
        accuracy[name] = share(lambda got, want: getattr(got, name) == getattr(want, name))
    return accuracy
