"""What the attention tests share: seeded inputs, the error against naive and its bounds per dtype, the
configs that chunk the test shapes, the backends that run on a CPU, and small stand-in backends."""
import torch

from sdopt.optim.attention.backends import AttentionConfig, Backend, Limits, backend_names, get_backend
from sdopt.optim.attention.config import ANY_DEVICE
from sdopt.optim.attention.kernels import naive_attention

# Largest |backend - naive| accepted here, per input dtype. Measured: fp32 stays near 1e-6;
# bf16 near 8e-3 (one bf16 ulp at |out| ~ 1-2, from SDPA's bf16 matmuls).
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
# Budgets small enough that sliced and sub_quadratic cut these shapes into several slices and
# key chunks (the online softmax really rescales).
TINY_BUDGET = 64 * 1024
CONFIGS = {"default": AttentionConfig(), "tiny-budget": AttentionConfig(memory_budget_bytes=TINY_BUDGET)}
CPU_BACKENDS = [name for name in backend_names() if get_backend(name).check("cpu").ok]


def qkv(batch, heads, q_tokens, k_tokens, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_tokens, head_dim, generator=generator)
    k = torch.randn(batch, heads, k_tokens, head_dim, generator=generator)
    v = torch.randn(batch, heads, k_tokens, head_dim, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def max_error(out, q, k, v, mask=None):
    return (out.float() - naive_attention(q, k, v, mask).float()).abs().max().item()


def missing(name, pip):
    """A backend that needs a package that is not installed anywhere."""
    return Backend(name, naive_attention, {ANY_DEVICE: Limits()}, module=f"sdopt_missing_{name}", pip=pip)


def rows_seen(name, fn, seen):
    """A backend that records how many query rows each call hands it."""
    def recorded(q, k, v, mask=None):
        seen.append(q.shape[2])
        return fn(q, k, v, mask)

    return Backend(name, recorded, {ANY_DEVICE: Limits()})
