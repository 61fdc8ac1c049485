"""Host tier: real ComfyUI from $COMFYUI_PATH, booted once per session with sdopt loaded.

Skipped, with the reason shown, when COMFYUI_PATH is unset (CI always sets it). Each family's mini
checkpoint (``sdopt-mini-sd15.safetensors``, ``sdopt-mini-sdxl.safetensors``) is generated once into
$SDOPT_TEST_MODELS (default: a session temp folder), the SDXL one when a test first asks for it.

``comfy_host`` is SD1.5's; ``comfy_host.family("sdxl")`` is the same host on the SDXL mini, with the
same helpers (``load_checkpoint``, ``sample``, ``checkpoint``). A test that takes ``family_host`` runs
once per family; ``sdxl_checkpoint`` is the SDXL file's path, for workflows and benches.

ComfyUI imports the pack under a module name of its own, so module state (the prompt logs in
``nodes.prompt_context``, the profiler's active run, the report node's last figures, the ``UserError``
class) lives in that copy: tests reach it through ``comfy_host.pack("nodes.prompt_context")`` (or
``comfy_host.patching``, ``.environment``, ``.prompt_context``, ``.fast_path``), never through the ``sdopt`` they import.
"""
import copy
import os
import re
import sys
import uuid
from functools import cached_property
from pathlib import Path

import pytest
import torch

from sdopt.errors import UserError
from sdopt.families import FAMILIES, Family

HOST_FAMILIES = ("sd15", "sdxl", "sd35", "flux")
# The diffusion transformers and the UNets: a test that takes ``dit_host`` (``unet_host``) runs once on each.
DIT_FAMILIES = ("sd35", "flux")
UNET_FAMILIES = ("sd15", "sdxl")
# Every family but Flux, whose mini (one block of each kind at the real width of 3072) costs seconds a
# step on a CPU: for tests with many samples whose subject SD3.5 shows for the diffusion transformers.
LEAN_FAMILIES = ("sd15", "sdxl", "sd35")
WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
# The plain sampling run that node tests compare patched clones on: 2 euler steps at 64x64.
STEPS, SIZE, SEED, CFG = 2, 64, 42, 7.0
PROMPT = "a lighthouse on a cliff"
# ComfyUI's node mode for a bypassed node (Ctrl+B).
BYPASSED = 4
# What workflow tests set on the shipped workflows (512x512, 20 steps) to stay fast on a CPU.
SMALL = ["KSampler.steps=2", "EmptyLatentImage.width=64", "EmptyLatentImage.height=64"]
# Workflow inputs of sd15_precision_attention.json that keep a CPU run fast and fp32-exact.
FP32_PRECISION_ATTENTION = [
    "SDOptPrecision.weight_dtype=default",
    "SDOptPrecision.compute_dtype=fp32",
    "SDOptPrecision.tf32=false",
    "SDOptVAEPrecision.dtype=default",
]


def _mini_checkpoint(models: Path, family: Family) -> Path:
    """``family``'s mini checkpoint in ``models``, generated (seed 0, fp16) where it is missing; a
    text encoder file of its own (Flux) goes into ``models/text_encoders``."""
    from sdopt.tools.modelgen import ensure_checkpoint

    text_encoder = family.text_encoder_filename("mini")
    return ensure_checkpoint(family.model_name("mini"), models / family.checkpoint_filename("mini"),
                             text_encoder_out=models / "text_encoders" / text_encoder if text_encoder else None)


def _file_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape in the safetensors file at ``path``, read from its header alone."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return {key: file.get_slice(key).get_shape() for key in file.keys()}


def _unloadable_reason(checkpoint: Path) -> str | None:
    """Why this ComfyUI cannot build the diffusion model of ``checkpoint`` with its shapes, or None.
    ComfyUI 0.3.64 fixes Flux's text width (``context_in_dim``) at T5-XXL's 4096 (0.3.75 reads it from
    ``txt_in.weight``), and sdopt's generated Flux carries CLIP-L's 768-wide token states
    (families/flux.py). Read from the file's header and ComfyUI's own detection, not from a
    version string."""
    import comfy.model_detection

    from sdopt.families import UNET_PREFIX

    state = {key: torch.empty(shape, device="meta") for key, shape in _file_shapes(checkpoint).items()
             if key.startswith(UNET_PREFIX)}
    text_in = state.get(UNET_PREFIX + "txt_in.weight")
    if text_in is None:
        return None
    detected = comfy.model_detection.detect_unet_config(state, UNET_PREFIX)
    width = detected.get("context_in_dim")
    if width != text_in.shape[1]:
        return (f"this ComfyUI builds Flux for {width or 'T5-XXL-wide (4096)'} text states whatever the checkpoint holds, "
                f"and sdopt's generated Flux takes CLIP-L's {text_in.shape[1]}-wide ones (a real Flux checkpoint loads)")
    return None


def _pack_module(name: str) -> property:
    """A ``ComfyHostFixture`` property: the pack's module ``name`` as ComfyUI loaded it (``pack(name)``)."""
    return property(lambda self: self.pack(name), doc=f"The pack's ``{name}`` as ComfyUI loaded it.")


class ComfyHostFixture:
    """The booted ComfyUI host plus one family's generated mini checkpoint, and the helpers host tests
    share (test modules cannot import conftest under ``--import-mode=importlib``). ``family(name)``
    gives the same host on another family's mini checkpoint."""

    WORKFLOWS = WORKFLOWS
    SMALL = SMALL
    FP32_PRECISION_ATTENTION = FP32_PRECISION_ATTENTION
    file_shapes = staticmethod(_file_shapes)

    def __init__(self, host, checkpoint: Path, model_family: Family, views: dict | None = None):
        self.host = host
        self.checkpoint = checkpoint
        self.model_family = model_family
        # One fixture per family for the whole session, so each checkpoint loads (and encodes) once.
        self._views = views if views is not None else {model_family.name: self}
        self.unloadable_reason = _unloadable_reason(checkpoint)

    def family(self, name: str) -> "ComfyHostFixture":
        """This host on family ``name``'s mini checkpoint (``"sd15"``, ``"sdxl"``), generated on first use;
        the test is skipped, with the reason, where this ComfyUI cannot load that checkpoint."""
        view = self.view(name)
        if view.unloadable_reason:
            pytest.skip(f"{name} mini: {view.unloadable_reason}")
        return view

    def view(self, name: str) -> "ComfyHostFixture":
        """``family(name)`` whether or not this ComfyUI can load its checkpoint (``unloadable_reason``)."""
        if name not in self._views:
            import folder_paths

            family = FAMILIES[name]
            self._views[name] = ComfyHostFixture(self.host, _mini_checkpoint(self.models, family), family, self._views)
            if family.text_encoder_filename("mini"):  # for workflows' Load CLIP as well as load_checkpoint
                folder_paths.add_model_folder_path("text_encoders", str(self.models / "text_encoders"))
        return self._views[name]

    @property
    def nodes(self) -> dict:
        return self.host.node_classes

    @property
    def models(self) -> Path:
        return self.checkpoint.parent

    @cached_property
    def _loaded(self):
        import nodes

        model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(self.checkpoint.name)[:3]
        text_encoder = self.model_family.text_encoder_filename("mini")
        if text_encoder:
            clip = nodes.CLIPLoader().load_clip(text_encoder, self.model_family.clip_type)[0]
        return model, clip, vae

    def load_checkpoint(self):
        """(model, clip, vae) of this family's mini checkpoint, loaded once and shared like ComfyUI's cache does."""
        return self._loaded

    def release(self) -> None:
        """Drop every model the session loaded, each family's and then the host's (``ComfyHost.release``)."""
        for view in self._views.values():
            view.__dict__.pop("_loaded", None)
            view.__dict__.pop("_conds", None)
        self.host.release()

    def pack(self, name: str):
        """Module ``name`` (e.g. ``"nodes.patching"``) of the pack as ComfyUI loaded it."""
        return self.host.pack(name)

    patching = _pack_module("nodes.patching")
    environment = _pack_module("nodes.environment")
    prompt_context = _pack_module("nodes.prompt_context")
    fast_path = _pack_module("nodes.fast_path")

    @cached_property
    def _conds(self):
        import nodes

        clip = self.load_checkpoint()[1]
        encode = nodes.CLIPTextEncode().encode
        return encode(clip, PROMPT)[0], encode(clip, "")[0]

    def sample(self, model, steps: int = STEPS, sampler: str = "euler") -> torch.Tensor:
        """The latent of ComfyUI's own KSampler path for ``model``, with fixed settings (SDXL's size
        conditioning comes from ComfyUI's defaults for a bare text encode)."""
        import nodes

        side = SIZE // 8
        latent = {"samples": torch.zeros(1, self.model_family.latent.channels, side, side)}
        positive, negative = self._conds
        return nodes.common_ksampler(model, SEED, steps, CFG, sampler, "normal", positive, negative, latent)[0]["samples"]

    def lora(self, convs: bool = False) -> str:
        """The name, in ComfyUI's loras folder, of a rank-4 LoRA of this family's mini UNet in ComfyUI's
        generic key format over every attention projection, and with ``convs`` over every conv of its
        first input blocks (LoCon style: down k x k, up 1 x 1); written on first use."""
        import folder_paths
        from safetensors.torch import save_file

        folder = Path(folder_paths.get_output_directory()) / "sdopt-test-loras"
        name = f"sdopt-test-{self.model_family.name}-{'conv-' if convs else ''}lora.safetensors"
        if not (folder / name).exists():
            generator = torch.Generator().manual_seed(3)
            tensors = {}
            for key, param in self.load_checkpoint()[0].model.diffusion_model.named_parameters():
                attention = any(part in key for part in (".to_q.", ".to_k.", ".to_v.", ".qkv."))
                conv = convs and param.ndim == 4 and key.startswith(("input_blocks.0.", "input_blocks.1."))
                if (attention or conv) and key.endswith(".weight"):
                    prefix = f"diffusion_model.{key[:-len('.weight')]}"
                    tensors[f"{prefix}.lora_down.weight"] = torch.randn(4, *param.shape[1:], generator=generator) * 0.05
                    tensors[f"{prefix}.lora_up.weight"] = torch.randn(param.shape[0], 4, *[1] * (param.ndim - 2), generator=generator) * 0.05
            folder.mkdir(parents=True, exist_ok=True)
            # Written aside and renamed: another pytest worker may be reading the name.
            partial = folder / f".{name}.{os.getpid()}.tmp"
            save_file(tensors, str(partial))
            os.replace(partial, folder / name)
        folder_paths.add_model_folder_path("loras", str(folder))
        return name

    @staticmethod
    def with_lora(model, name: str, strength: float):
        """``model`` through ComfyUI's own LoraLoaderModelOnly."""
        import nodes

        return nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)[0]

    def prompt(self, workflow, overrides=()) -> dict:
        """The API prompt of a workflow file (UI or API format) or dict, with ``--set`` overrides."""
        from sdopt.tools.workflow import load_workflow

        data = load_workflow(workflow) if isinstance(workflow, (str, Path)) else copy.deepcopy(workflow)
        return self.host.prompt_from(data, list(overrides))

    def run(self, workflow, overrides=()):
        """Run a workflow file (UI or API format) or an API prompt dict; returns a WorkflowOutcome."""
        return self.host.execute(self.prompt(workflow, overrides))

    def reports(self) -> list[dict]:
        """The ``sdopt.report`` events of the last prompt, as the browser would receive them."""
        return self.host._server.reports()

    @staticmethod
    def node_id(prompt: dict, class_type: str) -> str:
        """The id of the one node of ``class_type`` in an API prompt."""
        (found,) = [key for key, node in prompt.items() if node["class_type"] == class_type]
        return found

    @staticmethod
    def image(outcome, prefix: str):
        """The one image a workflow run saved under a name starting with ``prefix``, as int16 levels."""
        import numpy as np
        from PIL import Image

        (path,) = [p for p in outcome.images if p.name.startswith(prefix)]
        return np.asarray(Image.open(path), dtype=np.int16)

    @staticmethod
    def bypassed(workflow: dict, node_types) -> dict:
        """``workflow`` (UI format) with every node of ``node_types`` bypassed, as a user does with Ctrl+B."""
        for node in workflow["nodes"]:
            if node["type"] in node_types:
                node["mode"] = BYPASSED
        return workflow

    @staticmethod
    def compilations(run) -> int:
        """How many compilations the SDOptCompile record of a profiled run counts."""
        (record,) = [o for o in run["optimizations"] if o["node"] == "SDOptCompile"]
        return int(re.search(r"(\d+) compilation\(s\)", record["active"]).group(1))

    @staticmethod
    def wrapper_counts(model, key: str) -> dict[str, int]:
        """{WrappersMP type: number of wrappers} that ``model`` carries under ``key``, over every type."""
        return {kind: len(keys[key]) for kind, keys in model.wrappers.items() if keys.get(key)}


@pytest.fixture(scope="session")
def comfy_host(tmp_path_factory):
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        pytest.skip("host tier: COMFYUI_PATH is not set (point it at a ComfyUI checkout to run these)")
    from sdopt.tools.headless import boot

    os.environ.setdefault("SDOPT_CACHE_DIR", str(tmp_path_factory.mktemp("compile-cache")))
    models = Path(os.environ.get("SDOPT_TEST_MODELS") or tmp_path_factory.mktemp("models"))
    checkpoint = _mini_checkpoint(models, FAMILIES["sd15"])
    try:
        host = boot(path)
    except UserError as error:
        pytest.fail(f"COMFYUI_PATH is set but unusable: {error}")
    host.add_models_folder(models)
    host.set_output_folder(tmp_path_factory.mktemp("output"))
    fixture = ComfyHostFixture(host, checkpoint, FAMILIES["sd15"])
    yield fixture
    fixture.release()


def _hosts(name: str, families: tuple[str, ...], doc: str):
    """A fixture ``name`` that gives ``comfy_host`` on each of ``families``' mini checkpoints in turn."""
    def fixture(request, comfy_host):
        return comfy_host.family(request.param)

    fixture.__name__, fixture.__doc__ = name, doc
    return pytest.fixture(params=families, name=name)(fixture)


family_host = _hosts("family_host", HOST_FAMILIES, "``comfy_host`` on each family's mini checkpoint in turn: a test that takes it runs once per family.")
lean_host = _hosts("lean_host", LEAN_FAMILIES, "``comfy_host`` on each family's mini checkpoint but Flux's (see LEAN_FAMILIES).")
unet_host = _hosts("unet_host", UNET_FAMILIES, "``comfy_host`` on each UNet family's mini checkpoint (SD1.5, SDXL) in turn.")
dit_host = _hosts("dit_host", DIT_FAMILIES, "``comfy_host`` on each diffusion transformer's mini checkpoint (SD3.5, Flux) in turn.")


@pytest.fixture(scope="module")
def checkpoint(comfy_host):
    """(model, clip, vae) of the SD1.5 mini checkpoint, shared like ComfyUI's cache shares them."""
    return comfy_host.load_checkpoint()


@pytest.fixture(scope="session")
def sdxl_checkpoint(comfy_host) -> Path:
    """The SDXL mini checkpoint in the host's models folder (``sdopt-mini-sdxl.safetensors``)."""
    return comfy_host.family("sdxl").checkpoint


@pytest.fixture
def prompt_context(comfy_host):
    """A fresh prompt id set as ComfyUI's executing context, as while a node runs; records filed
    by decodes land in ``comfy_host.prompt_context.prompt_log(prompt_id)``."""
    from comfy_execution.utils import CurrentNodeContext

    prompt_id = f"test-{uuid.uuid4().hex}"
    with CurrentNodeContext(prompt_id, "1"):
        yield prompt_id


@pytest.fixture
def no_xformers(monkeypatch):
    """xformers cannot be imported, installed or not: the fallback path runs on every machine."""
    for name in ("xformers", "xformers.ops"):
        monkeypatch.setitem(sys.modules, name, None)
