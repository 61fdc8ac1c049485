"""Host tier: real ComfyUI from $COMFYUI_PATH, booted once per session with sdopt loaded.

Skipped, with the reason shown, when COMFYUI_PATH is unset. The mini checkpoint is
generated once into $SDOPT_TEST_MODELS (default: a session temp folder).
"""
import importlib
import os
from functools import cached_property
from pathlib import Path

import pytest
import torch

from sdopt.errors import UserError

CHECKPOINT = "sdopt-mini-sd15.safetensors"
# The plain sampling run that node tests compare patched clones on: 2 euler steps at 64x64.
STEPS, SIZE, SEED, CFG = 2, 64, 42, 7.0
PROMPT = "a lighthouse on a cliff"


class ComfyHostFixture:
    """The booted ComfyUI host plus the generated mini checkpoint."""

    def __init__(self, host, checkpoint: Path):
        self.host = host
        self.checkpoint = checkpoint

    @property
    def nodes(self) -> dict:
        return self.host.node_classes

    @cached_property
    def _loaded(self):
        import comfy.sd

        model, clip, vae, *_ = comfy.sd.load_checkpoint_guess_config(
            str(self.checkpoint), output_vae=True, output_clip=True
        )
        return model, clip, vae

    def load_checkpoint(self):
        """(model, clip, vae) of the mini checkpoint, loaded once and shared like ComfyUI's cache does."""
        return self._loaded

    def pack(self, name: str):
        """Module ``name`` (e.g. ``"nodes.records"``) of the pack as ComfyUI loaded it.

        ComfyUI imports the pack under a module name of its own, so module state (the
        profiler's active run, prompt notes, the ``UserError`` class) lives in that copy,
        not in the ``sdopt`` the tests import.
        """
        package = self.nodes["SDOptProfiler"].__module__.rsplit(".nodes.", 1)[0]
        return importlib.import_module(f"{package}.{name}")

    @cached_property
    def _conds(self):
        import nodes

        clip = self.load_checkpoint()[1]
        encode = nodes.CLIPTextEncode().encode
        return encode(clip, PROMPT)[0], encode(clip, "")[0]

    def sample(self, model) -> torch.Tensor:
        """The latent of ComfyUI's own KSampler path for ``model``, with fixed settings."""
        import nodes

        latent = {"samples": torch.zeros(1, 4, SIZE // 8, SIZE // 8)}
        positive, negative = self._conds
        return nodes.common_ksampler(model, SEED, STEPS, CFG, "euler", "normal", positive, negative, latent)[0]["samples"]

    def run(self, workflow, overrides=()):
        """Run a workflow file (UI or API format) or an API prompt dict; returns a WorkflowOutcome."""
        from sdopt.workflow import load_workflow

        data = load_workflow(workflow) if isinstance(workflow, (str, Path)) else workflow
        return self.host.execute(self.host.prompt_from(data, list(overrides)))


@pytest.fixture(scope="session")
def comfy_host(tmp_path_factory):
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        pytest.skip("host tier: COMFYUI_PATH is not set (point it at a ComfyUI checkout to run these)")
    from sdopt.nodes.headless import boot
    from sdopt.optim.modelgen import write_checkpoint

    models = Path(os.environ.get("SDOPT_TEST_MODELS") or tmp_path_factory.mktemp("models"))
    checkpoint = models / CHECKPOINT
    if not checkpoint.exists():
        write_checkpoint("mini", checkpoint, seed=0, dtype="fp16", progress=False)
    try:
        host = boot(path)
    except UserError as error:
        pytest.fail(f"COMFYUI_PATH is set but unusable: {error}")
    host.add_models_folder(models)
    host.set_output_folder(tmp_path_factory.mktemp("output"))
    return ComfyHostFixture(host, checkpoint)
