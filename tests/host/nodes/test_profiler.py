"""SDOptProfiler on a real ComfyUI model: profiling changes nothing numerically, leaves the
given model alone, files one run per sampling with a mark per step and the model's family (on each
family's mini checkpoint), and replaces its own wrappers when chained."""
import pytest
import torch

NODE = "SDOptProfiler"


def test_profiled_clone_samples_bit_identically_and_files_a_run(family_host, prompt_context):
    model = family_host.load_checkpoint()[0]
    prompts = family_host.prompt_context
    wrappers_before = {kind: dict(keys) for kind, keys in model.wrappers.items()}
    stock = family_host.sample(model)
    (profiled,) = family_host.nodes[NODE]().apply(model, "  unit  ")
    assert family_host.wrapper_counts(profiled, NODE) == {"outer_sample": 1, "sampler_sample": 1}
    out = family_host.sample(profiled)
    assert torch.equal(out, stock), "profiling must not change the result"
    assert {kind: dict(keys) for kind, keys in model.wrappers.items()} == wrappers_before
    assert torch.equal(family_host.sample(model), stock)
    (run,) = prompts.prompt_log(prompt_context).runs
    assert run["label"] == "unit" and len(run["steps"]) == 2
    assert run["model_family"] == family_host.model_family.title
    assert run["sampler_total_s"] >= sum(step["seconds"] for step in run["steps"])
    assert run["optimizations"] == []


def test_run_carries_the_model_records(comfy_host, prompt_context):
    model = comfy_host.load_checkpoint()[0]
    (patched,) = comfy_host.nodes["SDOptPrecision"]().patch(model, "default", "fp32", False, False)
    (first,) = comfy_host.nodes[NODE]().apply(patched, "first")
    (profiled,) = comfy_host.nodes[NODE]().apply(first, "second")
    assert comfy_host.wrapper_counts(profiled, NODE) == {"outer_sample": 1, "sampler_sample": 1}, "chained: replaced, not stacked"
    comfy_host.sample(profiled)
    (run,) = comfy_host.prompt_context.prompt_log(prompt_context).runs
    assert run["label"] == "second" and len(run["steps"]) == 2
    (record,) = run["optimizations"]
    assert record["node"] == "SDOptPrecision" and record["requested"].startswith("weight=default, compute=fp32")


def test_empty_label_is_refused(comfy_host):
    UserError = comfy_host.pack("errors").UserError
    with pytest.raises(UserError, match=r"^label: it is empty"):
        comfy_host.nodes[NODE]().apply(comfy_host.load_checkpoint()[0], "   ")
