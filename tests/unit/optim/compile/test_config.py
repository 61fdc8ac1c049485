"""CompileConfig and unavailable: settings checked, each unavailable backend with its fix; the NCHW
conv weights inductor would convert."""
import pytest
import torch

from sdopt.optim.compile import CompileConfig, nchw_conv_weight_bytes, unavailable
from sdopt.optim.precision import converted_copy


def test_nchw_conv_weights_are_counted_where_inductor_would_convert_them():
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Linear(3, 3), torch.nn.Conv2d(8, 2, 3))
    conv_bytes = (8 * 4 * 9 + 2 * 8 * 9) * 4
    assert nchw_conv_weight_bytes(module, CompileConfig()) == conv_bytes
    assert nchw_conv_weight_bytes(module, CompileConfig("compile_regional")) == conv_bytes
    assert nchw_conv_weight_bytes(converted_copy(module, torch.float32, channels_last=True), CompileConfig()) == 0
    assert nchw_conv_weight_bytes(module, CompileConfig("trace")) == 0
    assert nchw_conv_weight_bytes(module, CompileConfig(backend="aot_eager")) == 0


def test_config_and_availability():
    with pytest.raises(ValueError, match="mode must be one of"):
        CompileConfig("jit")
    reason, _fix, input_name = unavailable(CompileConfig(backend="cudagraphs"), torch.device("cpu"))
    assert input_name == "backend"
    assert "CUDA device" in reason
    assert unavailable(CompileConfig("trace"), torch.device("cpu")) is None
