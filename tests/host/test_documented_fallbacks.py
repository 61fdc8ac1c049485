"""What each node's documentation promises it does when it cannot run (falls back, passes the model
through, does nothing, stops) against the record it writes in that case, in real ComfyUI on this
CPU-only host.

The promises are read from each node's page (``web/docs/<NodeClass>.md``) and its DESCRIPTION: every sentence
that speaks of ``on_unavailable``, a fallback, a pass-through or doing nothing must have a scenario
here, keyed by the sentence itself, so that rewording a promise or adding one fails until its
scenario says what the record now shows. A scenario puts the node where it cannot run and checks
that the record names what ran instead, why, and the fix, and that ``error`` stops under the input the
fix concerns. That a passed-through model samples as the stock one does is each node's own host test's.
"""
import re

import pytest

from tests.unit.web.test_docs import page_paragraphs, page_path

PROMISE = re.compile(r"on_unavailable|falls? back|pass(?:es|ed)? (?:the model )?through|does nothing")


def sentences(text: str) -> list[str]:
    """``text`` split after each full stop outside parentheses."""
    found, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and text[index + 1:index + 2] in ("", " "):
            found.append(text[start:index + 1].strip())
            start = index + 1
    return found + ([text[start:].strip()] if text[start:].strip() else [])


def documented_promises(node_classes: dict) -> set[tuple[str, str]]:
    """(node class, sentence) for every promise in the node pages' paragraphs and the nodes' DESCRIPTIONs."""
    nodes = [name for name in node_classes if name.startswith("SDOpt")]
    texts = [(name, paragraph) for name in nodes if page_path(name).is_file() for paragraph in page_paragraphs(page_path(name).read_text())]
    texts += [(name, getattr(node_classes[name], "DESCRIPTION", "")) for name in nodes]
    return {(node, sentence) for node, text in texts for sentence in sentences(text) if PROMISE.search(sentence)}


def record_of(host, model, node: str) -> dict:
    (record,) = [r for r in host.patching.model_records(model.model_options) if r["node"] == node]
    return record


def refused(host, match: str):
    return pytest.raises(host.pack("errors").UserError, match=match)


def compile_backend_unavailable(host):
    """The cudagraphs backend on a CPU stands for the missing Triton or C++ compiler: the same path."""
    model = host.load_checkpoint()[0]
    compile_node = host.nodes["SDOptCompile"]()
    (passed,) = compile_node.patch(model, "compile", "cudagraphs", "default", False, False, "fallback")
    record = record_of(host, passed, "SDOptCompile")
    assert record["active"] == "eager", record
    assert "cudagraphs backend needs a CUDA device" in record["note"] and "(fix: pick backend inductor" in record["note"]
    assert host.fast_path.fast_path_of(passed) is None
    with refused(host, "^backend: the cudagraphs backend needs a CUDA device"):
        compile_node.patch(model, "compile", "cudagraphs", "default", False, False, "error")


def cuda_graph_on_a_cpu(host):
    model = host.load_checkpoint()[0]
    (passed,) = host.nodes["SDOptCUDAGraph"]().patch(model, 4, "fallback")
    record = record_of(host, passed, "SDOptCUDAGraph")
    assert record["active"] == "eager" and "(fix: run the model on a CUDA GPU)" in record["note"], record
    assert host.fast_path.fast_path_of(passed) is None


def step_cache_where_the_mode_does_not_fit(host):
    """Each way a mode cannot fit, on the family it does not fit: the note names what does."""
    cases = [
        (host, "first_block", 0, "not a diffusion transformer", "use mode deepcache", "uncached"),
        (host, "deepcache", 11, "branch 11 is past the UNet's", "choose a branch below", "eager"),
        (host.family("sd35"), "deepcache", 0, "not a UNet with down, middle and up blocks", "use mode first_block", "eager"),
    ]
    for family_host, mode, branch, reason, fix, active in cases:
        model = family_host.load_checkpoint()[0]
        node = family_host.nodes["SDOptStepCache"]()
        (passed,) = node.patch(model, mode, 3, branch, 0.0, 1.0, "fallback", 0.08)
        record = record_of(family_host, passed, "SDOptStepCache")
        assert record["active"] == active and reason in record["note"] and f"(fix: {fix}" in record["note"], record
        assert reason in record["short"], "the report's did-less-than-asked column says it ran uncached"
        with refused(family_host, f"^(mode|branch): .*{re.escape(reason)}.*; {fix}"):
            node.patch(model, mode, 3, branch, 0.0, 1.0, "error", 0.08)


def offload_on_a_cpu(host):
    model = host.load_checkpoint()[0]
    node = host.nodes["SDOptOffload"]()
    (passed,) = node.patch(model, "budget", 1024, "fallback")
    record = record_of(host, passed, "SDOptOffload")
    assert record["active"] == "no-op" and "(fix: set mode to none)" in record["note"], record
    assert record["short"].startswith("does nothing: the model runs on the CPU")
    with refused(host, "^mode: the model runs on the CPU"):
        node.patch(model, "sequential", 1024, "error")


def offload_without_a_delegate(host):
    """ComfyUI 0.38's dynamic VRAM is not on this host: tests/unit/nodes/test_offload.py fakes its
    model patcher and holds the record; here the page's promise names that test."""
    from tests.unit.nodes import test_offload

    assert callable(test_offload.test_a_dynamic_patcher_without_a_delegate_follows_on_unavailable)


def attention_backend_unavailable(host):
    model = host.load_checkpoint()[0]
    node = host.nodes["SDOptAttention"]()
    (fallen_back,) = node.patch(model, "flash_attn", "fallback", 0, 1024)
    record = record_of(host, fallen_back, "SDOptAttention")
    assert record["active"] == "sdpa" and "fallback from flash_attn to sdpa" in record["note"], record
    with refused(host, "^backend: flash_attn cannot run here"):
        node.patch(model, "flash_attn", "error", 0, 1024)


def vae_attention_backend_unavailable(host):
    vae = host.load_checkpoint()[2]
    node = host.nodes["SDOptVAEAttention"]()
    (fallen_back,) = node.patch(vae, "flash_attn", "fallback", 0, 1024)
    (record,) = [r for r in fallen_back.sdopt_records if r["node"] == "SDOptVAEAttention"]
    assert record["active"] == "sdpa" and "fallback from flash_attn to sdpa" in record["note"], record
    with refused(host, "^backend: flash_attn cannot run here"):
        node.patch(vae, "flash_attn", "error", 0, 1024)


SCENARIOS = {
    ("SDOptAttention", "**`on_unavailable`**: `fallback` (the default) runs sdpa instead"): attention_backend_unavailable,
    ("SDOptVAEAttention", "**`on_unavailable`**: as for sdopt Attention"): vae_attention_backend_unavailable,
    ("SDOptCompile", "**`on_unavailable`**: what happens where this machine cannot compile"): compile_backend_unavailable,
    ("SDOptCUDAGraph", "**`on_unavailable`**: on a CPU"): cuda_graph_on_a_cpu,
    ("SDOptStepCache", "**`on_unavailable`**: a model the mode does not fit"): step_cache_where_the_mode_does_not_fit,
    ("SDOptOffload", "**`on_unavailable`**: on a CPU (nothing to offload)"): offload_on_a_cpu,
    ("SDOptOffload", "On ComfyUI 0.38, whose dynamic VRAM streams"): offload_without_a_delegate,
}


@pytest.fixture(scope="module")
def promises(comfy_host) -> set[tuple[str, str]]:
    return documented_promises(comfy_host.nodes)


def test_every_documented_promise_has_a_scenario(promises):
    claimed = {(node, start) for node, sentence in promises for node_, start in SCENARIOS
               if node == node_ and sentence.startswith(start)}
    unclaimed = sorted(p for p in promises if not any(p[0] == n and p[1].startswith(s) for n, s in SCENARIOS))
    assert not unclaimed, f"documented with no scenario here: {unclaimed}"
    assert claimed == set(SCENARIOS), f"a scenario whose sentence is no longer documented: {set(SCENARIOS) - claimed}"


@pytest.mark.parametrize("scenario", list(dict.fromkeys(SCENARIOS.values())), ids=lambda scenario: scenario.__name__)
def test_the_record_keeps_the_documented_promise(comfy_host, scenario):
    scenario(comfy_host)
