"""A procedural captioned dataset: one flat shape on a flat background, as 64x64 pixel art on an 8x8 grid.

A scene is a shape, its colour, the background colour, the quadrant it sits in and its size; its caption
reads ``"a large red triangle on a blue background, top left"`` and ``scene_of_caption`` parses it back.
``render`` draws a scene so that every 8x8 pixel block is one flat colour: a VAE that averages 8x8 blocks
round-trips the image exactly. Rendering uses PIL and the standard library only, and depends on nothing but
(scene, seed).
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image

SHAPES = ("square", "circle", "triangle")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "white": (240, 240, 240),
    "black": (20, 20, 20),
}
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SIZES = ("small", "large")

IMAGE_SIZE = 64
GRID = 8
CELL = IMAGE_SIZE // GRID
# Side of the shape's bounding box, in cells.
SIZE_CELLS = {"small": 4, "large": 6}
MAX_JITTER = 1
# Drawn by hand rather than rasterised: at 4 and 6 cells a rasterised triangle loses its apex row, and
# these keep every pair of shapes at least 4 cells apart at either size.
MASKS = {
    ("square", "small"): ("####", "####", "####", "####"),
    ("circle", "small"): (".##.", "####", "####", ".##."),
    ("triangle", "small"): (".##.", ".##.", "####", "####"),
    ("square", "large"): ("######",) * 6,
    ("circle", "large"): (".####.", "######", "######", "######", "######", ".####."),
    ("triangle", "large"): ("..##..", "..##..", ".####.", ".####.", "######", "######"),
}

_CAPTION = re.compile(r"a (?P<size>\w+) (?P<colour>\w+) (?P<shape>\w+) on a (?P<background>\w+) background, "
                      r"(?P<position>\w+ \w+)")


@dataclass(frozen=True)
class Scene:
    """One scene of the dataset; ``caption`` is its prompt."""

    shape: str
    colour: str
    background: str
    position: str
    size: str

    @property
    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} on a {self.background} background, {self.position}"


def scene_of_caption(caption: str) -> Scene:
    """The scene a caption describes; ValueError for a caption outside the dataset's grammar or vocabulary."""
    match = _CAPTION.fullmatch(caption.strip())
    if match is None:
        raise ValueError(f"not a scene caption: {caption!r} (expected e.g. {all_scenes()[0].caption!r})")
    scene = Scene(**match.groupdict())
    vocabulary = {"shape": SHAPES, "colour": tuple(COLOURS), "background": tuple(COLOURS),
                  "position": POSITIONS, "size": SIZES}
    for attribute, names in vocabulary.items():
        if getattr(scene, attribute) not in names:
            raise ValueError(f"caption {caption!r}: unknown {attribute} {getattr(scene, attribute)!r} "
                             f"(one of {', '.join(names)})")
    if scene.colour == scene.background:
        raise ValueError(f"caption {caption!r}: the shape's colour is the background's")
    return scene


@lru_cache(maxsize=None)
def all_scenes() -> tuple[Scene, ...]:
    """Every scene whose shape colour differs from its background: 3*6*5*4*2 = 720, always in this order."""
    return tuple(Scene(shape, colour, background, position, size)
                 for shape, colour, background, position, size
                 in itertools.product(SHAPES, COLOURS, COLOURS, POSITIONS, SIZES) if colour != background)


def shape_mask(shape: str, size: str) -> tuple[tuple[bool, ...], ...]:
    """The cells the shape covers in its bounding box (rows of booleans, top row first)."""
    try:
        rows = MASKS[shape, size]
    except KeyError:
        raise ValueError(f"no mask for a {size} {shape} (shapes: {', '.join(SHAPES)}; sizes: "
                         f"{', '.join(SIZES)})") from None
    return tuple(tuple(cell == "#" for cell in row) for row in rows)


def shape_origin(scene: Scene, seed: int) -> tuple[int, int]:
    """The grid cell of the bounding box's top-left corner: the named corner of the grid, moved inwards by
    a jitter of 0 or 1 cells in x and y drawn from (seed, caption). A shape whose jitter would bring its
    centre onto the grid's middle line stays at the corner: it must still tell its quadrant."""
    cells = SIZE_CELLS[scene.size]
    jitter_room = min(MAX_JITTER, (GRID - cells - 1) // 2)
    draw = random.Random(f"{seed}:{scene.caption}")
    jitter_x, jitter_y = draw.randint(0, jitter_room), draw.randint(0, jitter_room)
    vertical, horizontal = scene.position.split()
    x = jitter_x if horizontal == "left" else GRID - cells - jitter_x
    y = jitter_y if vertical == "top" else GRID - cells - jitter_y
    return x, y


def render(scene: Scene, seed: int) -> Image.Image:
    """The scene as a 64x64 RGB image, every 8x8 block one flat colour; the same (scene, seed) gives the
    same bytes."""
    grid = Image.new("RGB", (GRID, GRID), COLOURS[scene.background])
    origin_x, origin_y = shape_origin(scene, seed)
    colour = COLOURS[scene.colour]
    for row, covered in enumerate(shape_mask(scene.shape, scene.size)):
        for column, inside in enumerate(covered):
            if inside:
                grid.putpixel((origin_x + column, origin_y + row), colour)
    return grid.resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST)
