"""optim.offload: what each mode keeps resident, given what the host loaded."""
import pytest
import torch

from sdopt.errors import UserError
from sdopt.optim.offload import MIB, OffloadConfig, plan_residency, unavailable

SIZE = 1000 * MIB


@pytest.mark.parametrize("mode, budget, loaded, resident, free, load", [
    ("none", 0, 400 * MIB, SIZE, 0, 600 * MIB),
    ("none", 0, SIZE, SIZE, 0, 0),
    ("budget", 300 * MIB, SIZE, 300 * MIB, 700 * MIB, 0),
    ("budget", 300 * MIB, 200 * MIB, 200 * MIB, 0, 0),  # never more than the host chose to load
    ("budget", 2 * SIZE, SIZE, SIZE, 0, 0),
    ("sequential", 0, SIZE, 0, SIZE, 0),
    ("unload_after", 0, 700 * MIB, 700 * MIB, 0, 0),
])
def test_plan_residency(mode, budget, loaded, resident, free, load):
    plan = plan_residency(OffloadConfig(mode, budget), SIZE, loaded)
    assert (plan.resident_bytes, plan.bytes_to_free, plan.bytes_to_load) == (resident, free, load)
    assert plan.unload_after == (mode == "unload_after")


def test_summary_names_resident_and_streamed_bytes():
    assert plan_residency(OffloadConfig("budget", 250 * MIB), SIZE, SIZE).summary() == (
        "250.0 of 1,000.0 MiB of weights resident, 750.0 MiB streamed per layer")
    assert plan_residency(OffloadConfig("none"), SIZE, SIZE).summary() == "1,000.0 of 1,000.0 MiB of weights resident"


@pytest.mark.parametrize("mode, budget, message", [("swap", 0, "^mode: 'swap'"), ("budget", -MIB, "^budget_mb: -1 is negative")])
def test_bad_config_names_the_input(mode, budget, message):
    with pytest.raises(UserError, match=message):
        OffloadConfig(mode, budget)


def test_only_a_cpu_is_unavailable():
    problem = unavailable(OffloadConfig(), torch.device("cpu"))
    assert "CPU" in problem.reason and (problem.fix, problem.input) == ("set mode to none", "mode")
    assert unavailable(OffloadConfig(), torch.device("cuda")) is None
