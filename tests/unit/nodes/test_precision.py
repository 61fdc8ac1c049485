"""SDOptPrecision on a checkpoint ComfyUI loaded with quantized weights: ``auto``, the default, keeps them
as loaded; a setting that needs a converted copy is refused under its own input, with its fix."""
import types

import pytest
import torch
from torch import nn

from sdopt.errors import UserError
from sdopt.nodes import patching
from sdopt.nodes.precision import SDOptPrecision

from .comfy_fakes import WrappedPatcher


class QuantizedConfig:
    """A model config as ComfyUI sets it for a mixed-precision (fp8, int8, nvfp4...) checkpoint."""

    quant_config = {"mixed_ops": True}
    supported_inference_dtypes = [torch.bfloat16, torch.float32]


class QuantizedPatcher(WrappedPatcher):
    """A patcher over a quantized Flux-like model on a GPU, where ``auto`` alone would pick another dtype."""

    load_device = torch.device("cuda")

    def __init__(self, model=None):
        super().__init__()
        self.model = model or types.SimpleNamespace(
            model_config=QuantizedConfig(), diffusion_model=nn.Sequential(nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)).to(torch.bfloat16))
        self.compute_dtype = None

    def clone(self):
        n = QuantizedPatcher(self.model)
        n.wrappers, n.model_options = super().clone().wrappers, super().clone().model_options
        return n

    def model_dtype(self):
        return torch.bfloat16

    def get_model_object(self, name):
        return None

    def set_model_compute_dtype(self, dtype):
        self.compute_dtype = dtype


@pytest.fixture
def comfy(monkeypatch, patcher_extension):
    return patcher_extension


def test_auto_keeps_quantized_weights_as_loaded(comfy):
    model = QuantizedPatcher()
    (patched,) = SDOptPrecision().patch(model, "auto", "default", False, False)
    assert patched is not model and patched.model is model.model, "a clone over the same weights, no converted copy"
    (entry,) = patching.model_records(patched.model_options)
    assert entry["active"].startswith("weight=bf16")
    assert "auto: weights kept as loaded: they are quantized" in entry["note"]


@pytest.mark.parametrize("inputs, named, fix", [
    (("fp16", "default", False, False), "weight_dtype", "set it to auto or default"),
    (("default", "default", False, True), "channels_last", "turn it off"),
    (("auto", "default", False, True), "channels_last", "turn it off"),
], ids=["weight_dtype", "channels_last", "auto+channels_last"])
def test_settings_that_need_a_converted_copy_are_refused_under_their_input(comfy, inputs, named, fix):
    with pytest.raises(UserError, match=rf"^{named}: this model holds quantized weights.*; {fix}"):
        SDOptPrecision().patch(QuantizedPatcher(), *inputs)
