"""The planner's models: a checkpoint file's architecture read from its diffusion model's keys and shapes
(SD1.5, SDXL, SD3.5, Flux: Flux.1-dev's keys are schnell's and more, so they must match exactly)."""
import pytest
import torch
from safetensors.torch import save_file

from sdopt.tools.modelgen import UNET_PREFIX, checkpoint_specs
from sdopt.tools.plan import architecture, architecture_of_shapes


def test_checkpoint_architecture_from_its_keys(tmp_path):
    unet = {k: torch.zeros(spec.shape, dtype=torch.float16).expand(spec.shape).contiguous()
            for k, spec in checkpoint_specs("mini").items() if k.startswith(UNET_PREFIX)}
    save_file(unet, tmp_path / "mini.safetensors")
    assert architecture(str(tmp_path / "mini.safetensors")) == "mini"


def test_sdxl_checkpoint_architecture_from_its_keys(tmp_path):
    unet = {k: torch.zeros(spec.shape, dtype=torch.float16) for k, spec in checkpoint_specs("sdxl-tiny").items()
            if k.startswith(UNET_PREFIX)}
    save_file(unet, tmp_path / "xl.safetensors")
    assert architecture(str(tmp_path / "xl.safetensors")) == "sdxl-tiny"
    save_file({f"{UNET_PREFIX}input_blocks.0.0.weight": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(Exception, match="matches none of the architectures"):
        architecture(str(tmp_path / "other.safetensors"))


def test_dit_checkpoint_architecture_from_its_keys(tmp_path):
    for name in ("sd35-tiny", "flux-tiny"):
        part = {k: torch.zeros(spec.shape, dtype=torch.float16) for k, spec in checkpoint_specs(name).items()
                if k.startswith(UNET_PREFIX)}
        save_file(part, tmp_path / f"{name}.safetensors")
        assert architecture(str(tmp_path / f"{name}.safetensors")) == name
    # Flux.1-dev holds every tensor of schnell and the guidance embedder: the keys must match exactly.
    for name in ("flux-schnell", "flux-full", "sd35-medium"):
        assert architecture_of_shapes({k: spec.shape for k, spec in checkpoint_specs(name).items()}) == name
