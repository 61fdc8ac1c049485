"""Fixtures of the nodes' unit tests: the real ComfyUI kept out, fakes of its modules put in for one test."""
import sys
import types
from collections import OrderedDict

import pytest

from sdopt.nodes import environment, prompt_context

from .comfy_fakes import PROMPT, WrappersMP, install


@pytest.fixture
def no_comfyui():
    """The unit tier must never see the real ComfyUI, before or after a test's fakes."""
    assert not any(name == "comfy" or name.startswith("comfy.") for name in sys.modules if not _is_fake(name))
    yield
    assert "comfy" not in sys.modules, "fakes are removed after each test"


def _is_fake(name):
    return getattr(sys.modules[name], "__file__", None) is None


@pytest.fixture
def prompts(monkeypatch):
    """A fresh per-prompt log, with ``PROMPT`` as the executing prompt."""
    monkeypatch.setattr(prompt_context, "_prompts", OrderedDict())
    monkeypatch.setattr(prompt_context, "current_prompt_id", lambda: PROMPT)
    return prompt_context._prompts


@pytest.fixture
def patcher_extension(monkeypatch):
    return install(monkeypatch, "comfy.patcher_extension", WrappersMP=WrappersMP)


@pytest.fixture
def comfy_attention(monkeypatch):
    """A fake of ComfyUI's attention module (``comfy.ldm.modules.attention``), as ``environment.comfy_attention`` returns it."""
    module = types.SimpleNamespace(get_attn_precision=lambda precision, dtype: precision)
    monkeypatch.setattr(environment, "comfy_attention", lambda: module)
    return module
