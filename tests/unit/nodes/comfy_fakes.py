"""Fakes of ComfyUI's APIs (0.3.x, 0.33 and 0.38 shapes) that the nodes' unit tests share.

ComfyUI is never imported in the unit tier: every ``comfy*`` module a function imports lazily is a fake
put into ``sys.modules`` for one test (``install``), built from what the real one offers (attribute
names, signatures, data layout of ``wrappers``). The fixtures that install them are in conftest.py.
"""
import copy
import sys
import types

import torch
from torch import nn

PROMPT = "prompt-1"


def install(monkeypatch, name: str, **attrs) -> types.ModuleType:
    """A fake module ``name`` in ``sys.modules`` for this test, also set on its (fake) parent package,
    as ``import a.b`` and ``a.b.x`` need."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    parent, _, child = name.rpartition(".")
    if parent:
        if parent not in sys.modules:
            install(monkeypatch, parent)
        monkeypatch.setattr(sys.modules[parent], child, module, raising=False)
    else:
        module.__path__ = []  # a package, so submodules import
    monkeypatch.setitem(sys.modules, name, module)
    return module


# ComfyUI's ``supported_models`` classes, as the type of ``model.model.model_config``: sdopt knows a
# family by these names (a fine-tune's config subclasses its base's).
class SD15:
    pass


class SDXL:
    pass


class SSD1B(SDXL):
    pass


class SD3:  # SD3 and SD3.5: ComfyUI runs no DIFFUSION_MODEL wrappers around its MMDiT
    pass


class AuraFlow:  # a ComfyUI model no sdopt family describes
    pass


def base_model(config_class, diffusion_model=None):
    """A BaseModel as the family lookup sees it."""
    return types.SimpleNamespace(model_config=config_class(), diffusion_model=diffusion_model or nn.Identity())


class ApplyModelExecutor:
    """ComfyUI's APPLY_MODEL executor: calling it runs ``fn``; ``class_obj`` is the BaseModel, whose
    ``diffusion_model`` is ``diffusion_model``."""

    def __init__(self, fn, diffusion_model=None):
        self.fn, self.class_obj = fn, types.SimpleNamespace(diffusion_model=diffusion_model or nn.Identity())

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    PREPARE_SAMPLING = "prepare_sampling"
    SAMPLER_SAMPLE = "sampler_sample"
    PREDICT_NOISE = "predict_noise"
    CALC_COND_BATCH = "calc_cond_batch"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"

    @classmethod
    def init_wrappers(cls):
        return {}


class WrappedPatcher:
    """ComfyUI's wrapper bookkeeping: ``wrappers[type][key] = [fn, ...]``, copied by ``clone``."""

    def __init__(self):
        self.wrappers = {}
        self.model_options = {"transformer_options": {}}

    def clone(self):
        n = WrappedPatcher()
        n.wrappers = {k: {k1: w.copy() for k1, w in v.items()} for k, v in self.wrappers.items()}
        n.model_options = copy.deepcopy(self.model_options)
        return n

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        w = self.wrappers.get(wrapper_type, {})
        if key in w:
            w.pop(key)

    def get_wrappers(self, wrapper_type, key):
        return self.wrappers.get(wrapper_type, {}).get(key, [])


class FakeVAE:
    """Like ComfyUI's VAE: a plain class with decode/encode methods and no clone()."""

    def __init__(self):
        self.calls = []
        self.first_stage_model = nn.Identity()

    def decode(self, samples):
        self.calls.append(("decode", samples))
        return samples * 2

    def encode(self, pixels):
        self.calls.append(("encode", pixels))
        return pixels / 2


def keyed_wrappers(patcher, key):
    return {kind: by_key[key] for kind, by_key in patcher.wrappers.items() if key in by_key}


class TinyUNet(nn.Module):
    """ComfyUI's UNetModel calling convention: ``_forward(x, timesteps, context, y, control, transformer_options)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.proj = nn.Linear(8, 4)
        self.seen_options = []

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}):
        self.seen_options.append(sorted(transformer_options))
        return self.conv(x) * timesteps[:, None, None, None] + self.proj(context).mean(1)[:, :, None, None]


class TinyXLUNet(TinyUNet):
    """SDXL's calling convention: a ``y`` vector (pooled text and size embeddings) beside the context."""

    def __init__(self):
        super().__init__()
        self.label_emb = nn.Linear(6, 4)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}):
        return super()._forward(x, timesteps, context, y, control, transformer_options) + self.label_emb(y)[:, :, None, None]


class TinyMMDiT(TinyXLUNet):
    """SD3's calling convention: ``forward`` itself runs the model, no ``_forward`` and no wrappers."""

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}):
        return TinyXLUNet._forward(self, x, timesteps, context, y, control, transformer_options)

    _forward = property()  # ComfyUI's MMDiT has none: a call of it must fail


class FastPatcher(WrappedPatcher):
    load_device = torch.device("cpu")

    def __init__(self, config_class=SD15):
        super().__init__()
        self.model = base_model(config_class)

    def clone(self):
        n = super().clone()
        n.__class__ = type(self)
        n.model = self.model
        return n

    def get_model_object(self, name):
        return getattr(self.model, name)


def unet_inputs(seed=0):
    """(x, timesteps, context) of one seeded UNet call: a batch of 2 latents of 4x8x8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 8, generator=g)


def sdxl_vector(seed):
    """The ``y`` vector TinyXLUNet takes beside ``unet_inputs(seed)``."""
    return torch.randn(2, 6, generator=torch.Generator().manual_seed(100 + seed))
