"""The soak's nodes come from the registry: every registered node that takes and returns a MODEL or a VAE
is drawn on that path, in the order of the soak's settings; a registered node the soak does not cover (a
patch with no random settings, or another node neither placed nor left out with a reason), and settings
for a node the registry lacks, stop the soak before it starts, naming the node."""
import pytest

from sdopt.nodes import registry
from sdopt.tools.cli import main
from sdopt.tools.soak import SOAK_NODES, SoakModel, plan_prompt, soak_nodes
from sdopt.tools.soak import drawn_nodes

CHECKPOINTS = {"sdopt-mini-sd15.safetensors": SoakModel("sdopt-soak-mini-lora.safetensors")}


def _node(takes: str | None, returns: tuple[str, ...]):
    class Node:
        RETURN_TYPES = returns
        FUNCTION = "patch"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {takes.lower(): (takes,), "strength": ("FLOAT", {"default": 1.0})} if takes else {}}

    return Node


def test_every_registered_model_and_vae_node_is_drawn_and_every_other_is_placed_or_left_out_with_a_reason():
    nodes = soak_nodes()
    paths = {name: drawn_nodes.patched_path(node) for name, node in registry.NODE_CLASS_MAPPINGS.items()}
    assert set(nodes.model) | {drawn_nodes.PROFILER} == {name for name, path in paths.items() if path == "MODEL"}
    assert set(nodes.vae) == {name for name, path in paths.items() if path == "VAE"}
    assert set(SOAK_NODES) | set(drawn_nodes.NOT_SOAKED) == set(registry.NODE_CLASS_MAPPINGS)
    assert all(drawn_nodes.NOT_SOAKED.values()), "a node left out says why"
    # The order of the draws is the settings' order, whatever the registry's: it fixes each seed's prompts.
    assert SOAK_NODES == (*nodes.model, drawn_nodes.PROFILER, *nodes.vae, drawn_nodes.REPORT)
    assert [name for name in drawn_nodes.SETTINGS if name in SOAK_NODES] == [name for name in SOAK_NODES if name != drawn_nodes.REPORT]


@pytest.mark.parametrize("path", ["MODEL", "VAE"])
def test_a_registered_patch_without_random_settings_stops_the_soak(monkeypatch, tmp_path, path):
    monkeypatch.setitem(registry.NODE_CLASS_MAPPINGS, "SDOptNewPatch", _node(path, (path,)))
    message = f"the registered node SDOptNewPatch takes and returns a {path}, and the soak has no random settings for it"
    with pytest.raises(RuntimeError, match=message):
        soak_nodes()
    with pytest.raises(RuntimeError, match="SDOptNewPatch"):
        plan_prompt(0, 0, CHECKPOINTS)
    with pytest.raises(RuntimeError, match="SDOptNewPatch"):  # before the server starts (there is no ComfyUI here)
        main(["soak", "--comfyui", str(tmp_path), "--prompts", "2"])


def test_a_registered_patch_with_random_settings_is_drawn_on_its_path(monkeypatch):
    monkeypatch.setitem(registry.NODE_CLASS_MAPPINGS, "SDOptNewPatch", _node("VAE", ("VAE",)))
    monkeypatch.setitem(drawn_nodes.SETTINGS, "SDOptNewPatch", lambda rng: {"strength": rng.choice((0.5, 1.0))})
    assert soak_nodes().vae[-1] == "SDOptNewPatch" and "SDOptNewPatch" not in soak_nodes().model
    drawn = [link for index in range(10) for link in plan_prompt(index, 0, CHECKPOINTS).vae_chain if link.class_type == "SDOptNewPatch"]
    assert drawn and {link.inputs["strength"] for link in drawn} <= {0.5, 1.0}


def test_another_registered_node_must_be_left_out_with_a_reason(monkeypatch):
    monkeypatch.setitem(registry.NODE_CLASS_MAPPINGS, "SDOptNewOutput", _node(None, ()))
    with pytest.raises(RuntimeError, match="the registered node SDOptNewOutput patches no MODEL or VAE"):
        soak_nodes()
    # A node that takes a MODEL and returns something else is no patch the soak could chain either.
    monkeypatch.setitem(registry.NODE_CLASS_MAPPINGS, "SDOptNewOutput", _node("MODEL", ("LATENT",)))
    with pytest.raises(RuntimeError, match="SDOptNewOutput patches no MODEL or VAE"):
        soak_nodes()
    monkeypatch.setitem(drawn_nodes.NOT_SOAKED, "SDOptNewOutput", "it writes a file, it patches nothing")
    assert "SDOptNewOutput" not in soak_nodes().all


def test_settings_for_a_node_the_registry_lacks_stop_the_soak(monkeypatch):
    monkeypatch.delitem(registry.NODE_CLASS_MAPPINGS, "SDOptTiledVAE")
    with pytest.raises(RuntimeError, match="it draws SDOptTiledVAE, which nodes/registry.py does not register"):
        soak_nodes()
