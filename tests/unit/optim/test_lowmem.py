"""Low-memory execution on CPU: chunked GroupNorm, row-sliced conv2d, token-sliced feed-forwards and
sequential batches each against the unchunked op, a tiny diffusers UNet under ``low_memory`` against
eager (inference mode too), the same on meta and fake tensors, and the model left as it was."""
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

import pytest

from sdopt.errors import UserError
from sdopt.optim.lowmem import (
    LowMemConfig,
    chunkable,
    chunked_group_norm,
    feedforward_working_bytes,
    low_memory,
    run_low_memory,
    sequential_batches,
    sliced_conv2d,
    token_sliced,
)

# Largest |chunked - reference| accepted, relative to max |reference|. fp32: the chunked ops
# compute the same sums in another order (measured: 0 for conv, ~3e-7 for GroupNorm and the UNet).
REL_TOL = 1e-5
# bf16 GroupNorm: the reference normalizes in float and rounds once, as the chunked one does; the
# difference is one bf16 rounding (2^-8) at most.
BF16_REL_TOL = 8e-3
# Small enough that every op of the tiny shapes here runs in several chunks.
TINY_BUDGET = 4096
# The tiny UNet's ops at 16x16, batch 1, take 32 KiB (conv input) to 512 KiB (feed-forward
# hidden): each runs in a few chunks, the feed-forwards in 16-token slices.
UNET_BUDGET = 16 * 1024


def assert_close_rel(out, ref, rel=REL_TOL):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    error = (out.float() - ref.float()).abs().max().item()
    assert error <= rel * ref.float().abs().max().item(), f"max abs diff {error:g} over {rel:g} x max|ref|"


class CountCalls(TorchFunctionMode):
    """Counts calls of the given torch functions (entered outside ``low_memory``, it sees the chunks)."""

    def __init__(self, *funcs):
        super().__init__()
        self.funcs, self.calls = funcs, {f: 0 for f in funcs}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.calls:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


class FeedForward(nn.Module):
    """ComfyUI's and diffusers' GEGLU feed-forward: Linear to 2*inner, x * gelu(gate), Linear back.
    Records the token count of each call that does real work."""

    def __init__(self, dim=16, inner=32):
        super().__init__()
        self.proj_in = nn.Linear(dim, 2 * inner)
        self.proj_out = nn.Linear(inner, dim)
        self.tokens_seen = []

    def forward(self, x):
        if x.shape[-2]:
            self.tokens_seen.append(x.shape[-2])
        value, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(value * F.gelu(gate))


# --- the ops -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 64, 37, 29), (1, 32, 16), (3, 8, 5, 6, 7)])
def test_chunked_group_norm_equals_group_norm(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 5  # an offset mean tests the variance merge
    weight, bias = torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
    assert_close_rel(chunked_group_norm(x, 8, weight, bias, 1e-6, budget_bytes=TINY_BUDGET), F.group_norm(x, 8, weight, bias, 1e-6))
    assert_close_rel(chunked_group_norm(x, 4, budget_bytes=TINY_BUDGET), F.group_norm(x, 4))


def test_chunked_group_norm_bf16_and_channels_last():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 12, 10, generator=g).to(memory_format=torch.channels_last)
    out = chunked_group_norm(x, 8, budget_bytes=TINY_BUDGET)
    assert_close_rel(out, F.group_norm(x, 8))
    assert out.is_contiguous(memory_format=torch.channels_last)
    half = x.bfloat16()
    assert_close_rel(chunked_group_norm(half, 8, budget_bytes=TINY_BUDGET), F.group_norm(half.float(), 8).bfloat16(), BF16_REL_TOL)


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), (3, 2, 1), (1, 1, 0), (1, 2, 0), (3, 1, 0), (4, 2, 1)])
@pytest.mark.parametrize("height", [16, 17])
def test_sliced_conv2d_equals_conv2d(kernel, stride, padding, height):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, height, 11, generator=g)
    weight, bias = torch.randn(12, 8, kernel, kernel, generator=g), torch.randn(12, generator=g)
    assert_close_rel(sliced_conv2d(x, weight, bias, stride, padding, budget_bytes=TINY_BUDGET), F.conv2d(x, weight, bias, stride, padding))


def test_sliced_conv2d_dilation_groups_and_channels_last():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 19, 9, generator=g).to(memory_format=torch.channels_last)
    weight = torch.randn(8, 4, 3, 3, generator=g)
    out = sliced_conv2d(x, weight, None, 1, (2, 1), (2, 1), 2, budget_bytes=TINY_BUDGET)
    assert_close_rel(out, F.conv2d(x, weight, None, 1, (2, 1), (2, 1), 2))
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_token_sliced_feedforward_equals_whole():
    torch.manual_seed(4)
    ff, x = FeedForward(), torch.randn(2, 50, 16)
    with torch.no_grad():
        assert_close_rel(token_sliced(ff, x, 7), ff(x))
    assert ff.tokens_seen[:-1] == [7] * 7 + [1]


class _DoubleStream(nn.Module):
    """Flux's shape: MLPs of a generic class (nn.Sequential), known only by their attribute names."""

    def __init__(self):
        super().__init__()
        self.img_mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 16))
        self.other = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        return self.other(self.img_mlp(x))


def test_feedforwards_named_by_attribute_are_sliced_within_the_given_model():
    torch.manual_seed(6)
    model, x = _DoubleStream(), torch.randn(2, 40, 16)
    config = LowMemConfig(TINY_BUDGET, sequential_cfg=False, feedforward_modules=("img_mlp",))
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append((module, args[0].shape[-2])) if isinstance(module, nn.Sequential) else None)
    try:
        with torch.no_grad():
            reference = model(x)
            seen.clear()
            with low_memory(config, within=model):
                out = model(x)
            sliced = [tokens for module, tokens in seen if module is model.img_mlp and tokens]
            others = [tokens for module, tokens in seen if module is model.other]
            seen.clear()
            with low_memory(config):
                model(x)
            unmatched = [tokens for module, tokens in seen if module is model.img_mlp and tokens]
    finally:
        handle.remove()
    assert_close_rel(out, reference)
    assert len(sliced) > 2 and max(sliced[1:]) < 40, "img_mlp ran over token slices"
    assert others == [40], "a Sequential not named is left whole"
    assert unmatched == [40], "without the model, an attribute name matches nothing"
    assert chunkable(model, config) == {"feed-forwards": 1, "GroupNorms": 0, "convs": 0}


def test_sequential_batches_slices_batched_tensors_and_passes_the_rest():
    g = torch.Generator().manual_seed(5)
    x, t, context = torch.randn(4, 3, 5, 5, generator=g), torch.rand(4, generator=g), torch.randn(4, 7, 3, generator=g)
    control = {"input": [torch.randn(4, 3, 5, 5, generator=g)], "scale": 0.5}
    shared = torch.randn(3, generator=g)  # dim 0 is not the batch: passed whole
    batches = []

    def fn(x, t, context=None, control=None, shared=None):
        batches.append(x.shape[0])
        mixed = x * t[:, None, None, None] + context.mean(dim=1)[:, :, None, None] + control["input"][0] * control["scale"]
        return mixed + shared[None, :, None, None], {"pooled": mixed.mean(dim=(2, 3))}

    whole = fn(x, t, context=context, control=control, shared=shared)
    batches.clear()
    split = sequential_batches(fn, x, t, context=context, control=control, shared=shared, batch_chunk=1)
    assert batches == [1, 1, 1, 1]
    assert_close_rel(split[0], whole[0])
    assert_close_rel(split[1]["pooled"], whole[1]["pooled"])
    batches.clear()
    sequential_batches(fn, x, t, context=context, control=control, shared=shared, batch_chunk=3)
    assert batches == [3, 1]


def test_each_part_can_be_labelled_in_containers_of_its_own():
    x, options = torch.zeros(3, 2), {"rows": None, "sigmas": torch.arange(3.0)}
    seen = []

    def label(rows, batch, args, kwargs):
        args[0]["rows"] = (rows.start, rows.stop, batch)
        kwargs["extra"]["rows"] = rows.start

    def fn(x, options, extra):
        seen.append((options["rows"], options["sigmas"].tolist(), extra["rows"]))
        return x

    sequential_batches(fn, x, options, extra={"rows": None}, batch_chunk=2, label_part=label)
    assert seen == [((0, 2, 3), [0.0, 1.0], 0), ((2, 3, 3), [2.0], 2)]
    assert options["rows"] is None, "the caller's containers are left alone"


# --- the context manager -------------------------------------------------------------------------


def test_low_memory_slices_only_what_exceeds_the_budget():
    torch.manual_seed(6)
    conv, norm = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8)
    ff, x = FeedForward(dim=8), torch.randn(1, 8, 16, 16)

    def run(budget):
        ff.tokens_seen.clear()
        with CountCalls(F.conv2d, F.group_norm) as counted, low_memory(LowMemConfig(budget_bytes=budget)):
            out = ff(norm(conv(x)).flatten(2).transpose(1, 2))
        return out, counted.calls, list(ff.tokens_seen)

    with torch.no_grad():
        eager = ff(norm(conv(x)).flatten(2).transpose(1, 2))
        big, big_calls, big_tokens = run(1 << 30)
        small, small_calls, small_tokens = run(TINY_BUDGET)
    assert big_calls == {F.conv2d: 1, F.group_norm: 1} and big_tokens == [256]
    assert small_calls[F.conv2d] > 1 and small_calls[F.group_norm] == 0  # GroupNorm's chunks are not group_norm calls
    assert max(small_tokens) < 256 and sum(small_tokens) == 256
    assert_close_rel(big, eager)
    assert_close_rel(small, eager)


def tiny_inputs(size=16, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, size, size, generator=g), torch.tensor([10, 500]), torch.randn(2, 5, 32, generator=g)


def unet_call(unet):
    return lambda x, t, context: unet(x, t, encoder_hidden_states=context).sample


@pytest.mark.parametrize("inference_mode", [False, True], ids=["no_grad", "inference_mode"])
def test_tiny_unet_under_low_memory_equals_eager(tiny_unet, inference_mode):
    x, t, context = tiny_inputs()
    before = {name: p.clone() for name, p in tiny_unet.state_dict().items()}
    config = LowMemConfig(budget_bytes=UNET_BUDGET)
    with torch.inference_mode() if inference_mode else torch.no_grad():
        eager = unet_call(tiny_unet)(x, t, context)
        with CountCalls(F.conv2d) as counted:
            low = run_low_memory(config, unet_call(tiny_unet), x, t, context)
        with CountCalls(F.conv2d) as counted_eager:
            unet_call(tiny_unet)(x, t, context)
    assert counted.calls[F.conv2d] > 2 * counted_eager.calls[F.conv2d]  # two sequential halves, then slices
    assert_close_rel(low, eager)
    after = tiny_unet.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_the_model_is_untouched_after_the_block(tiny_unet):
    ff = next(m for m in tiny_unet.modules() if type(m).__name__ == "FeedForward")
    hooks = lambda: [(m._forward_hooks, m._forward_pre_hooks) for m in tiny_unet.modules() if m._forward_hooks or m._forward_pre_hooks]
    x, t, context = tiny_inputs()
    with torch.no_grad():
        with CountCalls(nn.functional.linear) as inside, low_memory(LowMemConfig(budget_bytes=UNET_BUDGET)):
            assert hooks() == []
            ff(torch.randn(2, 256, ff.net[0].proj.in_features))
        with CountCalls(nn.functional.linear) as outside:
            ff(torch.randn(2, 256, ff.net[0].proj.in_features))
    assert inside.calls[F.linear] > outside.calls[F.linear] == 2  # sliced inside, one pass after the block
    assert hooks() == []


def test_tiny_unet_runs_on_meta_and_fake_tensors(tiny_unet):
    config = LowMemConfig(budget_bytes=UNET_BUDGET)
    with torch.device("meta"):
        meta_unet = type(tiny_unet)(**tiny_unet.config)
    x, t, context = (v.to("meta") for v in tiny_inputs())
    with torch.no_grad(), CountCalls(F.conv2d) as counted:
        out = run_low_memory(config, unet_call(meta_unet), x, t, context)
    assert out.shape == (2, 4, 16, 16) and out.device.type == "meta"
    assert counted.calls[F.conv2d] > 2 * sum(isinstance(m, nn.Conv2d) for m in tiny_unet.modules())
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as fake:
        inputs = tuple(fake.from_tensor(v) for v in tiny_inputs())
        out = run_low_memory(config, unet_call(tiny_unet), *inputs)
    assert out.shape == (2, 4, 16, 16)


def test_feedforward_working_bytes_from_the_widest_layer():
    ff, x = FeedForward(dim=16, inner=32), torch.empty(2, 50, 16)
    assert feedforward_working_bytes(ff, x) == 2 * 64 * 100 * 4


@pytest.mark.parametrize("field,value", [("budget_bytes", 0), ("batch_chunk", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(UserError, match=field):
        LowMemConfig(**{"budget_bytes": 1 << 20, field: value})
