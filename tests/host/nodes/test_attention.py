"""SDOptAttention and SDOptVAEAttention in real ComfyUI, on the mini SD1.5 checkpoint and, for the
model's attention, on the mini SDXL (its 2- and 10-block transformers) and SD3.5 (joint text+image
attention, v handed over split into heads) too, and on Flux (joint attention with rotary q and k) for
the main backends (CPU, fp32).

Sampling is 2 euler steps at 64x64 (an 8x8 latent). The patched clone must reproduce the stock
latent within ``REL_TOL`` of its largest magnitude, and the model it was made from must keep
producing the stock latent bit for bit. Every backend that runs on this device is held to that on
both families; the others fall back to sdpa (tested through a missing package).

The nodes come from ComfyUI's own import of the pack (under a module name of ComfyUI's choosing),
and module-level state (the profiler's active run, the prompt logs, the ``UserError`` class) is
per imported copy, so those are taken from that copy through ``comfy_host.pack``.
"""
import copy
import uuid

import pytest
import torch

from sdopt.optim.attention import AUTO, AttentionConfig, attention_choices, expected_backend

# |patched - stock| / max|stock| on the sampled latent. The random-weight mini model amplifies
# float rounding (latent magnitude ~450 after cfg 7): ComfyUI's own attention_pytorch and
# attention_split differ from its CPU default (sub_quad) by 3.2e-6 and 2.9e-6 of it; sdopt's
# sdpa/naive/sliced/sub_quadratic measured 2.8e-6 to 3.5e-6; on the SDXL mini (latent magnitude
# ~600) up to 6.4e-6.
REL_TOL = 1e-5
# |patched - stock| on decoded pixels in [0, 1] (measured: about 1e-6).
VAE_ATOL = 1e-5
HOST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# auto and every backend that runs here as itself; the others fall back to sdpa
BACKENDS = [b for b in attention_choices() if b == AUTO or expected_backend(AttentionConfig(backend=b), HOST_DEVICE)[0] == b]


def _mini(host):
    model, _, vae = host.load_checkpoint()
    return {"model": model, "vae": vae, "sample": host.sample, "stock": host.sample(model), "family": host.model_family}


@pytest.fixture(scope="module")
def mini(comfy_host):
    return _mini(comfy_host)


@pytest.fixture(scope="module", params=["sd15", "sdxl", "sd35"])
def family_mini(comfy_host, request):
    """Each family's mini checkpoint in turn, with its stock latent."""
    return _mini(comfy_host.family(request.param))


def _patch(comfy_host, model, backend, on_unavailable="fallback", slice_size=0, memory_budget_mb=32):
    (patched,) = comfy_host.nodes["SDOptAttention"]().patch(model, backend, on_unavailable, slice_size, memory_budget_mb)
    return patched


def test_nodes_are_registered_with_every_backend(comfy_host):
    for name in ("SDOptAttention", "SDOptVAEAttention"):
        inputs = comfy_host.nodes[name].INPUT_TYPES()["required"]
        assert inputs["backend"][0] == list(attention_choices())
        assert inputs["on_unavailable"][0] == ["fallback", "error"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_sampling_matches_stock_and_leaves_the_model_alone(comfy_host, family_mini, backend):
    mini = family_mini
    model, stock = mini["model"], mini["stock"]
    options_before = copy.copy(model.model_options)
    patched = _patch(comfy_host, model, backend)
    out = mini["sample"](patched)
    assert (out - stock).abs().max().item() <= REL_TOL * stock.abs().max().item(), mini["family"].title
    assert torch.equal(mini["sample"](model), stock), "the model the node was given must be unchanged"
    assert model.model_options == options_before
    (record,) = comfy_host.patching.model_records(patched.model_options)
    assert record["node"] == "SDOptAttention" and record["requested"] == backend
    assert record["active"] == ("auto (pending)" if backend == "auto" else backend)


# Flux's mini costs seconds a step here: the backends with their own kernels or chunking, and auto.
FLUX_BACKENDS = ["auto", "sdpa", "sub_quadratic", "naive"]


@pytest.fixture(scope="module")
def flux_mini(comfy_host):
    return _mini(comfy_host.family("flux"))


@pytest.mark.parametrize("backend", FLUX_BACKENDS)
def test_flux_joint_attention_matches_stock_and_leaves_the_model_alone(comfy_host, flux_mini, backend):
    """Flux hands attention q and k already split into heads and rotated (``skip_reshape``)."""
    model, stock = flux_mini["model"], flux_mini["stock"]
    patched = _patch(comfy_host, model, backend)
    assert (flux_mini["sample"](patched) - stock).abs().max().item() <= REL_TOL * stock.abs().max().item()
    assert torch.equal(flux_mini["sample"](model), stock), "the model the node was given must be unchanged"
    (record,) = comfy_host.patching.model_records(patched.model_options)
    assert record["active"] == ("auto (pending)" if backend == "auto" else backend)


def test_override_is_shared_by_downstream_clones(comfy_host, mini):
    patched = _patch(comfy_host, mini["model"], "auto")
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert copy.deepcopy(override) is override, "a plain function: deep copies keep one auto cache"
    assert patched.clone().model_options["transformer_options"]["optimized_attention_override"] is override
    assert "optimized_attention_override" not in mini["model"].model_options.get("transformer_options", {})


def test_chained_nodes_keep_one_record_and_the_second_override(comfy_host, mini):
    first = _patch(comfy_host, mini["model"], "naive")
    second = _patch(comfy_host, first, "sub_quadratic")
    (record,) = comfy_host.patching.model_records(second.model_options)
    assert record["requested"] == "sub_quadratic"
    overrides = [m.model_options["transformer_options"]["optimized_attention_override"] for m in (first, second)]
    assert overrides[0] is not overrides[1]
    run = comfy_host.pack("measure.profiler").SamplingRun("chained", mini["model"].load_device, [record])
    with run.memory_scope():
        out = mini["sample"](second)
    (ran,) = run.optimizations
    assert (ran["requested"], ran["active"]) == ("sub_quadratic", "sub_quadratic"), "the second node's backend ran"
    assert (out - mini["stock"]).abs().max().item() <= REL_TOL * mini["stock"].abs().max().item()


def test_auto_pick_reaches_the_profiled_run(comfy_host, family_mini):
    from sdopt.optim.attention import backend_names

    mini = family_mini
    SamplingRun = comfy_host.pack("measure.profiler").SamplingRun
    patched = _patch(comfy_host, mini["model"], "auto")
    run = SamplingRun("attention", mini["model"].load_device, comfy_host.patching.model_records(patched.model_options))
    with run.memory_scope():
        run.start()
        mini["sample"](patched)
        run.finish()
    (record,) = run.result().optimizations
    picks = record["active"].split(", ")
    assert picks and set(picks) <= set(backend_names())
    assert "ms" in record["note"] and "rejected:" in record["note"]


def test_missing_package_falls_back_or_raises(comfy_host, family_mini, no_xformers):
    mini = family_mini
    UserError = comfy_host.pack("errors").UserError

    patched = _patch(comfy_host, mini["model"], "xformers")
    (record,) = comfy_host.patching.model_records(patched.model_options)
    assert record["active"] == "sdpa"
    assert record["note"] == "fallback from xformers to sdpa: xformers is not installed: pip install xformers"
    out = mini["sample"](patched)
    assert (out - mini["stock"]).abs().max().item() <= REL_TOL * mini["stock"].abs().max().item()
    with pytest.raises(UserError, match="pip install xformers"):
        _patch(comfy_host, mini["model"], "xformers", on_unavailable="error")


@pytest.mark.parametrize("backend", ["sub_quadratic", "auto"])
def test_vae_node_patches_only_during_decode(comfy_host, mini, backend):
    from comfy_execution.utils import CurrentNodeContext

    prompts = comfy_host.prompt_context
    vae, latent = mini["vae"], mini["stock"]
    blocks = comfy_host.pack("nodes.vae_attention").attention_blocks(vae)
    assert blocks, "the SD VAE has mid-block attention"
    stock_attention = [block.optimized_attention for block in blocks]
    expected = vae.decode(latent)
    expected_tiled = vae.decode_tiled(latent, 8, 8, 2)
    prompt_id = f"attention-vae-{backend}-{uuid.uuid4().hex}"
    with CurrentNodeContext(prompt_id, "1"):
        (patched,) = comfy_host.nodes["SDOptVAEAttention"]().patch(vae, backend, "fallback", 0, 32)
        assert patched is not vae
        decoded = patched.decode(latent)
        tiled = patched.decode_tiled(latent, 8, 8, 2)
    assert (decoded - expected).abs().max().item() <= VAE_ATOL
    assert (tiled - expected_tiled).abs().max().item() <= VAE_ATOL
    assert [block.optimized_attention for block in blocks] == stock_attention, "restored after the decode"
    assert torch.equal(vae.decode(latent), expected), "the given VAE keeps the stock attention"
    (record,) = prompts.prompt_log(prompt_id).records
    assert record["node"] == "SDOptVAEAttention" and record["requested"] == backend
    assert record["active"] != "auto (pending)"
    if backend == "sub_quadratic":
        assert record["active"] == "sub_quadratic"
    assert not hasattr(vae, "sdopt_records") or vae.sdopt_records == [], "the given VAE carries no record"


def test_workflow_reports_what_ran(comfy_host):
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": comfy_host.checkpoint.name}},
        "2": {
            "class_type": "SDOptAttention",
            "inputs": {"model": ["1", 0], "backend": "auto", "on_unavailable": "fallback", "slice_size": 0, "memory_budget_mb": 32},
        },
        "3": {"class_type": "SDOptProfiler", "inputs": {"model": ["2", 0], "label": "attention"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a lighthouse"}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": ""}},
        "6": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "7": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["3", 0], "seed": 0, "steps": 2, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
                "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0], "denoise": 1.0,
            },
        },
        "8": {
            "class_type": "SDOptVAEAttention",
            "inputs": {"vae": ["1", 2], "backend": "sub_quadratic", "on_unavailable": "fallback", "slice_size": 0, "memory_budget_mb": 32},
        },
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["8", 0]}},
        "10": {"class_type": "SDOptProfileReport", "inputs": {"filename_prefix": "sdopt/attention", "images": ["9", 0]}},
    }
    report = comfy_host.run(prompt).report.to_dict()
    (run,) = report["runs"]
    (model_record,) = [o for o in run["optimizations"] if o["node"] == "SDOptAttention"]
    assert model_record["requested"] == "auto" and model_record["active"] != "auto (pending)"
    (vae_record,) = [o for o in report["optimizations"] if o["node"] == "SDOptVAEAttention"]
    assert vae_record["active"] == "sub_quadratic"
