"""Unit-tier fixtures: the generated ``tiny`` SD1.5-architecture models, as diffusers modules."""
import pytest
import torch
from diffusers import UNet2DConditionModel

from sdopt.tools.modelgen import diffusers_unet_config


@pytest.fixture()
def tiny_unet():
    """A fresh, seeded, random-weight UNet with the ``tiny`` checkpoint's shapes (32/64 channels)."""
    torch.manual_seed(0)
    return UNet2DConditionModel(**{**diffusers_unet_config("tiny"), "sample_size": 8}).eval()
