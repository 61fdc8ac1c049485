"""nodes.lowmem (SDOptLowMemory's wrappers) against fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import pytest
import torch
from torch import nn

from .comfy_fakes import SD15, SDXL, ApplyModelExecutor, FastPatcher, TinyXLUNet, keyed_wrappers, sdxl_vector, unet_inputs

pytestmark = pytest.mark.usefixtures("no_comfyui")


class Mlp(nn.Module):
    """A token-wise feed-forward under a class name only a family can tell Low Memory about."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 8)
        self.tokens_seen = []

    def forward(self, x):
        self.tokens_seen.append(x.shape[-2])
        return self.down(torch.relu(self.up(x)))


@torch.inference_mode()
def test_low_memory_slices_the_feedforward_modules_its_family_names(patcher_extension, comfy_attention, monkeypatch):
    import dataclasses

    from sdopt import families
    from sdopt.nodes.lowmem import NODE, SDOptLowMemory

    comfy_attention.wrap_attn = object()
    monkeypatch.setitem(families.FAMILIES, "sdxl", dataclasses.replace(families.SDXL, feedforward_modules=("Mlp",)))
    x = torch.randn(1, 4096, 8)  # hidden activations of 2 MiB against a 1 MiB budget
    tokens = {}
    for config_class in (SDXL, SD15):
        (m,) = SDOptLowMemory().patch(FastPatcher(config_class), 1, False, True)
        (apply_model,) = keyed_wrappers(m, NODE)["apply_model"]
        mlp = Mlp()
        torch.testing.assert_close(apply_model(ApplyModelExecutor(lambda x, *a, **k: mlp(x), mlp), x, None), Mlp()(x), rtol=1e-5, atol=1e-6)
        tokens[config_class.__name__] = max(mlp.tokens_seen)
    assert tokens == {"SDXL": 2048, "SD15": 4096}, "only the family that names Mlp slices it"


@torch.inference_mode()
def test_sequential_cfg_splits_sdxls_y_with_the_batch(patcher_extension, comfy_attention):
    from sdopt.nodes.lowmem import NODE, SDOptLowMemory

    comfy_attention.wrap_attn = object()
    (m,) = SDOptLowMemory().patch(FastPatcher(SDXL), 256, True, True)
    (apply_model,) = keyed_wrappers(m, NODE)["apply_model"]
    unet, seen = TinyXLUNet(), []

    def executor(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        seen.append((x.shape[0], kwargs["y"].shape[0]))
        return unet._forward(x, t, c_crossattn, kwargs["y"])

    x, t, context = unet_inputs()
    y = sdxl_vector(0)
    out = apply_model(ApplyModelExecutor(executor, unet), x, t, None, context, None, {}, y=y)
    assert seen == [(1, 1), (1, 1)], "cond and uncond one after the other, each with its own y"
    torch.testing.assert_close(out, unet._forward(x, t, context, y), rtol=1e-5, atol=1e-6)
