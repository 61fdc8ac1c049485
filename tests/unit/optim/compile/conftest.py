"""Every compile test starts and ends with dynamo reset, and without speed trials unless it tests them."""
import pytest
import torch

from sdopt.optim.compile import forward as forward_module


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_speed_trials(request, monkeypatch):
    """Every test but the speed trial's own looks at compiled code, which a trial's eager call would skip."""
    if "speed_trial" not in request.node.name:
        monkeypatch.setattr(forward_module, "TRIAL_CALLS", 0)
