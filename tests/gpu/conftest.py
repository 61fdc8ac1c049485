"""GPU tier: CUDA-only behaviour and figures. Every test here is skipped, with the reason shown, without CUDA."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: CUDA is not available on this machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
