"""The shipped attribute classifier: the pinned weights, held-out renders read right in either image
layout, and the prompt accuracy it scores."""
import pytest
import torch

from sdopt.errors import UserError
from sdopt.tools.reference.classifier import (ATTRIBUTES, RETRAIN, WEIGHTS, WEIGHTS_SHA256, held_out,
                                              load_classifier, prompt_accuracy, read_scenes, weights_sha256)
from sdopt.tools.reference.scenes import Scene

REQUIRED_ACCURACY = 0.98


@pytest.fixture(scope="module")
def classifier():
    return load_classifier()


@pytest.fixture(scope="module")
def held_out_200():
    return held_out(200)


def test_the_shipped_weights_are_the_pinned_ones():
    assert WEIGHTS.is_file(), f"missing {WEIGHTS}: {RETRAIN}"
    assert weights_sha256() == WEIGHTS_SHA256, f"{WEIGHTS} is not the pinned file: {RETRAIN}, then pin its sha256"


def test_missing_weights_name_the_retrain_command(tmp_path):
    with pytest.raises(UserError, match="train-reference classifier"):
        load_classifier(tmp_path / "absent.safetensors")


def test_held_out_renders_are_read_right(classifier, held_out_200):
    wanted, images = held_out_200
    assert len(wanted) == 200 and images.shape == (200, 3, 64, 64)
    accuracy = prompt_accuracy(read_scenes(classifier, images), wanted)
    assert all(accuracy[name] >= REQUIRED_ACCURACY for name in ATTRIBUTES), accuracy


def test_channels_last_images_read_the_same(classifier, held_out_200):
    _, images = held_out_200
    assert read_scenes(classifier, images.permute(0, 2, 3, 1)) == read_scenes(classifier, images)


def test_images_of_another_layout_are_refused(classifier):
    with pytest.raises(ValueError, match="expected images"):
        read_scenes(classifier, torch.zeros(2, 4, 64, 64))


def test_prompt_accuracy_counts_each_attribute():
    wanted = [Scene("circle", "red", "blue", "top left", "small"),
              Scene("square", "green", "white", "bottom right", "large")]
    read = [Scene("circle", "red", "green", "top left", "small"),  # all but the background
            Scene("triangle", "green", "white", "bottom right", "large")]  # all but the shape
    assert prompt_accuracy(read, wanted) == {"shape_colour": 0.5, "all": 0.0, "shape": 0.5, "colour": 1.0,
                                             "background": 0.5, "position": 1.0, "size": 1.0}
    assert prompt_accuracy(wanted, wanted)["all"] == 1.0
    with pytest.raises(ValueError):
        prompt_accuracy(read, wanted[:1])
