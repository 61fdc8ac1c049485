"""The per-signature callable under torch.compile: one backend for every shape so far is no shape lookup."""
import torch

from sdopt.optim.attention.backends import AttentionConfig
from sdopt.optim.attention.dispatch import build_attention


def test_a_dynamic_compile_with_one_backend_serves_every_resolution():
    """With one backend picked for every shape so far, the compiled code does not look the shape
    up: a lookup would guard on it and a dynamic compile would recompile per resolution."""
    from sdopt.optim.compile import CompileConfig, compile_forward

    attention = build_attention(AttentionConfig(backend="sdpa"))

    def attend(_module, x):
        q = x.flatten(2).transpose(1, 2).unsqueeze(1)
        return attention(q, q, q)

    torch._dynamo.reset()
    fast = compile_forward(torch.nn.Identity(), attend, CompileConfig(backend="eager", dynamic=True))
    for size in (4, 6, 8):
        x = torch.randn(1, 8, size, size)
        fast(x)  # the first call of a shape runs eagerly and decides its backend
        torch.testing.assert_close(fast(x), attend(None, x))
    torch._dynamo.reset()
    assert fast.stats.compilations == 1, fast.stats.summary()
