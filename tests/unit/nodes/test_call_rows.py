"""nodes.call_rows: the rows of a batch each part of a split call describes (sequential cfg, batch splits).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import pytest

from sdopt.nodes import call_rows

pytestmark = pytest.mark.usefixtures("no_comfyui")


def test_each_part_of_a_split_batch_describes_its_own_rows():
    """cfg with two images: ComfyUI's lists hold one entry per conditioning, two rows each."""
    options = {"cond_or_uncond": [0, 1], "uuids": ["c", "u"], "sigmas": "sliced elsewhere"}
    parts = []
    for start in range(4):
        part = (dict(options), "t")
        call_rows.label_batch_rows(slice(start, start + 1), 4, part, {})
        parts.append(part[0])
    assert [(p["cond_or_uncond"], p["uuids"], p[call_rows.BATCH_ROWS]) for p in parts] == [
        ([0], ["c"], (0, 1)), ([0], ["c"], (1, 2)), ([1], ["u"], (2, 3)), ([1], ["u"], (3, 4))]
    assert len({call_rows.call_key(p) for p in parts}) == 4, "equal shapes, so the step caches tell the parts apart by their rows"
    assert call_rows.call_key(options) == ((0, 1), None) and options["cond_or_uncond"] == [0, 1], "the whole call's options are left alone"
    pair = {"transformer_options": {"cond_or_uncond": [0, 1], "uuids": ["c", "u"]}}
    call_rows.label_batch_rows(slice(0, 2), 4, (), pair)
    assert pair["transformer_options"]["cond_or_uncond"] == [0] and pair["transformer_options"][call_rows.BATCH_ROWS] == (0, 2)
    odd = {"cond_or_uncond": [0, 1], "uuids": ["c", "u"]}
    call_rows.label_batch_rows(slice(0, 1), 3, (odd,), {})
    assert odd == {"cond_or_uncond": [0, 1], "uuids": ["c", "u"], call_rows.BATCH_ROWS: (0, 1)}, "rows that fit no entry: only the rows"
