"""Fixtures of the doctor's check tests: sdopt Precision's auto pick faked (it times bf16 against fp32 on a CPU)."""
import pytest
import torch

from sdopt.optim import precision as precision_module
from sdopt.optim.precision import AutoPick


@pytest.fixture(autouse=True)
def fast_precision_pick(monkeypatch):
    """pick_dtype times bf16 against fp32 on a CPU (seconds); its answer is not what these tests check."""
    monkeypatch.setattr(precision_module, "pick_dtype", lambda device: AutoPick(torch.float32, "faked pick"))
