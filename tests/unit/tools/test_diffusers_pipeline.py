"""diffusers' own UNet and pipeline over a generated checkpoint's weights (bench speed's competitor rungs):
every UNet weight comes from the file, the pipeline that fits the UNet runs from given embeddings and
noise, and is timed per step."""
import pytest
import torch
from safetensors import safe_open

from sdopt.errors import UserError
from sdopt.tools.diffusers_pipeline import NoiseSchedule, build_samplers, load_unet, unavailable_reason
from sdopt.tools.modelgen import SIZES, UNET_PREFIX, write_checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints") / "sdopt-tiny-sd15.safetensors"
    write_checkpoint("tiny", path, seed=3, dtype="fp32")
    return path


def test_every_unet_weight_comes_from_the_checkpoint(tiny_checkpoint):
    unet = load_unet(tiny_checkpoint, "tiny")
    assert not any(t.is_meta for t in (*unet.parameters(), *unet.buffers()))
    with safe_open(str(tiny_checkpoint), "pt") as file:
        stored = file.get_tensor(UNET_PREFIX + "input_blocks.0.0.weight")
        assert torch.equal(unet.conv_in.weight, stored)
        assert torch.equal(unet.time_embedding.linear_1.weight, file.get_tensor(UNET_PREFIX + "time_embed.0.weight"))
    assert sum(p.numel() for p in unet.parameters()) == sum(
        t.numel() for t in (file_tensors(tiny_checkpoint)))


def file_tensors(path):
    with safe_open(str(path), "pt") as file:
        return [file.get_tensor(k) for k in file.keys() if k.startswith(UNET_PREFIX)]


def test_the_sd15_pipeline_samples_from_given_embeddings_and_noise(tiny_checkpoint):
    plain, compiled = build_samplers(tiny_checkpoint, "tiny", "cpu", NoiseSchedule(), (False, True))
    assert type(plain.pipeline).__name__ == "StableDiffusionPipeline"
    assert plain.pipeline.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert "max-autotune" in compiled.recipe and "max-autotune" not in plain.recipe and "SDPA" in plain.recipe
    assert compiled.pipeline.unet._orig_mod is plain.pipeline.unet, "one UNet for both rungs"
    generator = torch.Generator().manual_seed(0)
    positive, negative = ({"embeds": torch.randn(1, 77, 32, generator=generator), "pooled": torch.randn(1, 32)} for _ in range(2))
    noise = torch.randn(1, 4, 16, 16, generator=generator)
    latents, run, wall = plain.sample(positive, negative, noise, 4, 7.0)
    again, _, _ = plain.sample(positive, negative, noise, 4, 7.0)
    assert latents.shape == noise.shape and torch.isfinite(latents).all() and torch.equal(latents, again)
    other, _, _ = plain.sample(positive, negative, noise, 4, 1.0)
    assert not torch.equal(latents, other), "the guidance scale reaches the pipeline"
    assert len(run["steps"]) == 4 and run["steady_it_per_s"] > 0 and wall >= run["sampler_total_s"] > 0
    assert run["optimizations"][0]["node"] == "diffusers" and run["memory_kind"] == "ram_rss"


@pytest.mark.skipif("sdxl-tiny" not in SIZES, reason="the generated models have no SDXL yet")
def test_a_unet_with_a_text_time_vector_gets_the_sdxl_pipeline(tmp_path):
    path = tmp_path / "sdopt-tiny-sdxl.safetensors"
    write_checkpoint("sdxl-tiny", path, seed=0, dtype="fp32")
    (sampler,) = build_samplers(path, "sdxl-tiny", "cpu", NoiseSchedule(), (False,))
    assert type(sampler.pipeline).__name__ == "StableDiffusionXLPipeline"
    context = sampler.pipeline.unet.config.cross_attention_dim
    pooled = sampler.pipeline.unet.config.projection_class_embeddings_input_dim - 6 * sampler.pipeline.unet.config.addition_time_embed_dim
    positive, negative = ({"embeds": torch.randn(1, 77, context), "pooled": torch.randn(1, pooled)} for _ in range(2))
    latents, run, _ = sampler.sample(positive, negative, torch.randn(1, 4, 16, 16), 2, 5.0)
    assert torch.isfinite(latents).all() and len(run["steps"]) == 2


def test_what_the_rungs_cannot_run_on(tmp_path, monkeypatch):
    assert unavailable_reason("mini") is None
    assert "is a file" in unavailable_reason(str(tmp_path / "my.safetensors"))
    with pytest.raises(UserError, match="--rungs diffusers: .* is a file"):
        build_samplers(tmp_path / "my.safetensors", str(tmp_path / "my.safetensors"), "cpu", NoiseSchedule(), (False,))
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)
    assert unavailable_reason("mini").startswith("diffusers is not installed")
