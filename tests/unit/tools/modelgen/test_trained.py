"""tools.modelgen.trained: the int8 storage of the reference models' weights (error bound, round trip,
the file appearing whole), the refusals that name the fix, and the shipped files being the ones the
code expects."""
from __future__ import annotations

import pytest
import torch

from sdopt.errors import UserError
from sdopt.families import MODEL_NAMES, UNET_PREFIX, checkpoint_config
from sdopt.tools.modelgen import checkpoint_specs, trained
from sdopt.tools.modelgen.files import write_safetensors
from sdopt.tools.modelgen.specs import TensorSpec


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(8, 4, 3, 3, generator=generator), "conv.bias": torch.randn(8, generator=generator),
            "linear.weight": torch.randn(5, 7, generator=generator) * 100}


def test_int8_storage_is_within_half_a_step_of_each_row_and_keeps_small_tensors_in_fp16():
    state = _state()
    restored = trained.dequantized(trained.quantized(state))
    assert set(restored) == set(state)
    for key in ("conv.weight", "linear.weight"):
        rows = state[key].reshape(state[key].shape[0], -1)
        step = rows.abs().amax(dim=1, keepdim=True) / 127
        error = (restored[key].reshape(rows.shape) - rows).abs()
        assert (error <= step / 2 + 1e-6).all()
        assert error.max() > 0  # it is lossy: the reference is what is stored, not the float weights
    torch.testing.assert_close(restored["conv.bias"], state["conv.bias"].half().float(), rtol=0, atol=0)


def test_saved_weights_load_back_as_stored(tmp_path):
    path = trained.save_trained("ref-sd15", _state(), tmp_path / "weights.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"]  # no temporary file left
    loaded = trained.load_trained("ref-sd15", path)
    expected = trained.dequantized(trained.quantized(_state()))
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_missing_weights_name_the_retrain_command(tmp_path):
    with pytest.raises(UserError, match="python -m sdopt train-reference ref-sd15"):
        trained.load_trained("ref-sd15", tmp_path / "absent.safetensors")


def test_a_shipped_file_that_is_not_the_expected_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(trained, "WEIGHTS_DIR", tmp_path)
    trained.save_trained("ref-sd15", _state())
    monkeypatch.setitem(trained.WEIGHTS_SHA256, "ref-sd15", "0" * 64)
    with pytest.raises(UserError, match="sha256 differs"):
        trained.load_trained("ref-sd15")


REFERENCE_MODELS = [name for name in MODEL_NAMES if checkpoint_config(name).trained]


@pytest.mark.parametrize("model", REFERENCE_MODELS)
def test_the_shipped_weights_are_the_ones_the_code_expects(model):
    assert model in trained.WEIGHTS_SHA256, f"put the sha256 of {model}'s weights in tools/modelgen/trained.py"
    path = trained.weights_path(model)
    assert path.exists(), f"{path} is missing: restore it from the repository"
    assert trained.file_sha256(path) == trained.WEIGHTS_SHA256[model]
    state = trained.load_trained(model)
    specs = {key.removeprefix(UNET_PREFIX): spec for key, spec in checkpoint_specs(model).items() if key.startswith(UNET_PREFIX)}
    assert {key: tuple(tensor.shape) for key, tensor in state.items()} == {key: spec.shape for key, spec in specs.items()}


def test_the_shipped_weights_fit_the_repository_s_budget():
    """Issue 49: the trained weights, the classifier's included, at most 40 MB in all."""
    sizes = {path.name: path.stat().st_size for path in trained.WEIGHTS_DIR.glob("*.safetensors")}
    assert {f"{model}.safetensors" for model in REFERENCE_MODELS} <= sizes.keys()
    assert sum(sizes.values()) <= 40_000_000, sizes


def test_given_tensors_replace_generated_ones_in_the_written_file(tmp_path):
    from safetensors.torch import load_file

    specs = {"a": TensorSpec((2, 2), std=1.0), "b": TensorSpec((3,), std=1.0)}
    given = {"a": torch.arange(4.0).reshape(2, 2)}
    path, _ = write_safetensors(specs, tmp_path / "x.safetensors", {}, seed=0, dtype="fp32", desc="x", progress=False,
                                given=given)
    written = load_file(path)
    assert torch.equal(written["a"], given["a"])
    assert not torch.equal(written["b"], torch.zeros(3))
