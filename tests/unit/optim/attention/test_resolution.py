"""Resolution of a named backend: fallback with a note, the error mode's one line, no backend at all,
and what a config will run before any tensor exists."""
import dataclasses

import pytest
import torch

from sdopt.errors import UserError
from sdopt.optim.attention.backends import AttentionConfig, Limits, get_backend
from sdopt.optim.attention.config import LOW_MEMORY, SDPA_FUSED
from sdopt.optim.attention.resolution import (
    LOW_MEMORY_NOTE,
    NoAttentionBackend,
    Resolved,
    expected_backend,
    resolve_backend,
    resolve_backend_for_device,
)

from .support import missing, qkv


def test_fallback_goes_to_sdpa_with_a_note(registered):
    registered(missing("needs_pkg", "needs-pkg"))
    q, k, v = qkv(1, 2, 8, 8, 16)
    resolved = resolve_backend("needs_pkg", q, k, v, on_unavailable="fallback")
    assert resolved.name == "sdpa" and resolved.fell_back
    assert resolved.note == "fallback from needs_pkg to sdpa: needs-pkg is not installed: pip install needs-pkg"
    assert resolve_backend("sliced", q, k, v) == Resolved("sliced", "sliced")


def test_fallback_skips_sdpa_when_it_cannot_run(registered):
    registered(dataclasses.replace(get_backend("sdpa"), limits={"cuda": Limits()}))
    q, k, v = qkv(1, 2, 8, 8, 16)
    resolved = resolve_backend("sdpa_efficient", q, k, v)
    assert resolved.name == "sub_quadratic"
    assert "fallback from sdpa_efficient to sub_quadratic" in resolved.note


def test_error_mode_raises_one_line_naming_the_requirement(registered):
    registered(missing("needs_pkg", "needs-pkg"))
    q, k, v = qkv(1, 2, 8, 8, 16)
    with pytest.raises(UserError) as error:
        resolve_backend("needs_pkg", q, k, v, on_unavailable="error")
    assert "pip install needs-pkg" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="needs CUDA"):
        resolve_backend_for_device("sdpa_efficient", "cpu", "error")
    assert resolve_backend_for_device("sdpa_efficient", "cuda", "error").name == "sdpa_efficient"


def test_nothing_can_run_raises_its_own_user_error():
    """Its own class, so that a host with attention of its own runs that instead (the nodes' fallback)."""
    q, k, v = qkv(1, 2, 8, 8, 16, torch.float64)
    with pytest.raises(NoAttentionBackend, match="no attention backend can run here") as error:
        resolve_backend("sdpa", q, k, v)
    assert isinstance(error.value, UserError)


def test_low_memory_on_a_device_without_fused_kernels_says_sub_quadratic_before_it_runs():
    assert expected_backend(AttentionConfig(backend=LOW_MEMORY), "cpu")[0].startswith(SDPA_FUSED)
    active, note = expected_backend(AttentionConfig(backend=LOW_MEMORY), "mps")
    assert active == "sub_quadratic" and note.startswith(LOW_MEMORY_NOTE) and "mps" in note
