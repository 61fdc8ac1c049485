"""The procedural scenes: deterministic renders, 720 distinct captions that parse back, flat 8x8 blocks,
the shape in its quadrant, and shapes that differ on the grid."""
import itertools

import pytest

from sdopt.tools.reference.scenes import (COLOURS, GRID, IMAGE_SIZE, SHAPES, SIZES, Scene, all_scenes, render,
                                          scene_of_caption, shape_mask)

CELL = IMAGE_SIZE // GRID


def _cells(image) -> list[list[tuple[int, int, int]]]:
    """The grid's colours, one per 8x8 block, asserting each block is one flat colour."""
    pixels = image.load()
    grid = []
    for row in range(GRID):
        grid.append([])
        for column in range(GRID):
            block = {pixels[column * CELL + x, row * CELL + y] for x in range(CELL) for y in range(CELL)}
            assert len(block) == 1, f"block ({row}, {column}) is not flat: {block}"
            grid[-1].append(block.pop())
    return grid


def test_a_scene_renders_to_the_same_bytes_and_seeds_move_it():
    scene = Scene("circle", "red", "blue", "top left", "small")
    assert render(scene, 3).tobytes() == render(scene, 3).tobytes()
    assert len({render(scene, seed).tobytes() for seed in range(20)}) > 1


def test_there_are_720_distinct_captions_that_parse_back():
    scenes = all_scenes()
    assert len({scene.caption for scene in scenes}) == len(scenes) == 720
    assert all(scene_of_caption(scene.caption) == scene for scene in scenes)
    assert scenes[0].caption == "a small red square on a green background, top left"
    assert Scene("triangle", "red", "blue", "top left", "large").caption == \
        "a large red triangle on a blue background, top left"


@pytest.mark.parametrize("caption", ["a large red hexagon on a blue background, top left",
                                     "a large red square on a red background, top left",
                                     "a large red square on a blue background, middle",
                                     "a red square"])
def test_a_caption_outside_the_dataset_is_refused(caption):
    with pytest.raises(ValueError, match="caption"):
        scene_of_caption(caption)


def test_every_block_is_flat_and_holds_the_scene_colours():
    for scene in all_scenes()[::7]:
        image = render(scene, 11)
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE) and image.mode == "RGB"
        colours = {colour for row in _cells(image) for colour in row}
        assert colours == {COLOURS[scene.colour], COLOURS[scene.background]}


def test_the_shape_sits_in_its_quadrant():
    for scene, seed in itertools.product(all_scenes()[::5], range(4)):
        cells = [(row, column) for row, colours in enumerate(_cells(render(scene, seed)))
                 for column, colour in enumerate(colours) if colour == COLOURS[scene.colour]]
        mask = shape_mask(scene.shape, scene.size)
        assert len(cells) == sum(map(sum, mask))
        centre_row = sum(row for row, _ in cells) / len(cells)
        centre_column = sum(column for _, column in cells) / len(cells)
        vertical, horizontal = scene.position.split()
        middle = (GRID - 1) / 2
        assert (centre_row < middle) == (vertical == "top"), (scene.caption, seed, centre_row)
        assert (centre_column < middle) == (horizontal == "left"), (scene.caption, seed, centre_column)


@pytest.mark.parametrize("size", SIZES)
def test_the_shapes_differ_by_at_least_three_cells(size):
    masks = {shape: shape_mask(shape, size) for shape in SHAPES}
    for first, second in itertools.combinations(SHAPES, 2):
        different = sum(a != b for row_a, row_b in zip(masks[first], masks[second]) for a, b in zip(row_a, row_b))
        assert different >= 3, (first, second, size)


def test_small_and_large_differ_in_extent():
    for shape in SHAPES:
        assert len(shape_mask(shape, "small")) < len(shape_mask(shape, "large"))
