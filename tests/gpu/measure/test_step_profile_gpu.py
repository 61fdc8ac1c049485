"""The step profile on CUDA: kernels are the device's busy time, and a value read is a host sync."""
import torch

from sdopt.measure.step_profile import profile_device


def test_kernels_make_the_busy_time_and_a_value_read_is_one_sync():
    def work():
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
        for _ in range(20):
            a = torch.tanh(a @ a)
        return a.float().sum().item()

    work()
    _, activity = profile_device(work, "cuda")
    assert activity.activities >= 40 and activity.busy_us > 0
    assert activity.host_syncs >= 1
    assert activity.top and activity.top[0][1] > 0 and not activity.top[0][0].startswith(("aten::", "cuda"))
    step = activity.per_step(1, activity.busy_us / 1e6)
    assert step.bound_by == "device"
