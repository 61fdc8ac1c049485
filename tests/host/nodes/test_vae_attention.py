"""SDOptVAEAttention in real ComfyUI on the SDXL, SD3.5 and Flux mini checkpoints' VAEs (the
4-channel LDM VAE and the 16-channel one; fp32 on CPU): every
backend the node offers decodes like the unpatched VAE, the input VAE's attention and output are
unchanged, and the record names the backend that ran."""
import pytest
import torch

NODE = "SDOptVAEAttention"
# fp32 attention backends against ComfyUI's own on the decoded image (values ~1): only the float
# rounding of other reduction orders may differ.
ATOL = 1e-4
LATENT = 8  # 64x64 px: 4,096 tokens in the mid-block attention


@pytest.fixture(scope="module", params=["sdxl", "sd35", "flux"])
def host(comfy_host, request):
    return comfy_host.family(request.param)


@pytest.fixture(scope="module")
def vae(host):
    return host.load_checkpoint()[2]


@pytest.fixture(scope="module")
def latent(host):
    return torch.randn(1, host.model_family.latent.channels, LATENT, LATENT, generator=torch.Generator().manual_seed(0))


def decode(vae, latent):
    with torch.inference_mode():
        return vae.decode(latent)


@pytest.fixture(scope="module")
def reference(vae, latent):
    return decode(vae, latent)


def backends(comfy_host) -> list[str]:
    return comfy_host.nodes[NODE].INPUT_TYPES()["required"]["backend"][0]


def test_every_backend_decodes_like_the_unpatched_vae(comfy_host, vae, latent, reference, prompt_context):
    blocks = comfy_host.pack("nodes.vae_attention").attention_blocks(vae)
    assert blocks, "the VAE has attention blocks"
    before = [block.optimized_attention for block in blocks]
    for backend in backends(comfy_host):
        (patched,) = comfy_host.nodes[NODE]().patch(vae, backend, "fallback", 0, 32)
        out = decode(patched, latent)
        assert out.shape == reference.shape
        assert (out - reference).abs().max().item() <= ATOL, backend
        record = {r["node"]: r for r in comfy_host.prompt_context.prompt_log(prompt_context).records}[NODE]
        assert record["requested"] == backend and record["active"], record
        assert [block.optimized_attention for block in blocks] == before, "the input VAE keeps its attention"
    assert torch.equal(decode(vae, latent), reference)
