"""SDOptTiledVAE's input checks, against ComfyUI 0.3.75's validation rule (ComfyUI is not imported
here; the host tier runs its real ``validate_prompt``).

ComfyUI files a VALIDATE_INPUTS failure under every input the method takes, and checks ``min`` and
``max`` only of the inputs it does not take (``execution.validate_inputs``). A problem that passes
validation fails when the node runs, with a ``UserError`` that names its input. Each bad input
must end up with one message, under its own name.
"""
import inspect

import pytest

from sdopt.errors import UserError
from sdopt.nodes.tiled_vae import SDOptTiledVAE, _TilingAutoencoder
from sdopt.optim.tiled_vae import TiledVAEConfig

VALID = {"tile": 256, "overlap": 0, "budget_mb": 0}


def comfy_validation(node_class, values: dict) -> list[tuple[str, str]]:
    """(input name, message) of every error ComfyUI 0.3.75's validation files for these widget values."""
    required = node_class.INPUT_TYPES()["required"]
    taken = inspect.getfullargspec(node_class.VALIDATE_INPUTS).args
    errors = []
    for name, value in values.items():
        spec = required[name][1]
        if name not in taken:
            if value < spec.get("min", value):
                errors.append((name, f"Value {value} smaller than min of {spec['min']}"))
            elif value > spec.get("max", value):
                errors.append((name, f"Value {value} bigger than max of {spec['max']}"))
    result = node_class.VALIDATE_INPUTS(**{name: values[name] for name in taken if name in values})
    if result is not True:
        errors += [(name, str(result)) for name in taken if name in values]
    return errors


def run_error(values: dict) -> str | None:
    """The node's error for these values, run on no VAE: past valid inputs, the missing VAE's."""
    try:
        SDOptTiledVAE().apply(None, only_when_needed=False, **values)
    except UserError as error:
        return str(error)
    return None


def what_the_user_sees(values: dict) -> list[tuple[str, str]]:
    """Validation errors if any (the node then never runs), else the run's error under the input it names."""
    errors = comfy_validation(SDOptTiledVAE, values)
    if errors:
        return errors
    message = run_error(values)
    return [(message.split(":")[0], message)] if message else []


@pytest.mark.parametrize(("name", "value", "message"), [
    ("tile", 100, "tile: 100 px is not a multiple of 8"),
    ("tile", 32, "tile: 32 px is under the 64 px minimum"),
    ("overlap", 256, "overlap: 256 px must be smaller than tile (256 px)"),
    ("overlap", 12, "overlap: 12 px must be 0 or a positive multiple of 8"),
    ("overlap", -8, "Value -8 smaller than min of 0"),
    ("budget_mb", -1, "Value -1 smaller than min of 0"),
])
def test_each_bad_input_gets_one_message_under_its_own_name(name, value, message):
    seen = what_the_user_sees({**VALID, name: value})
    assert len(seen) == 1, seen
    assert seen[0][0] == name and message in seen[0][1]


def test_the_run_names_a_bad_budget_itself_when_it_comes_through_a_link():
    """A linked budget_mb skips ComfyUI's minimum check; the node names it when it runs."""
    assert run_error({**VALID, "budget_mb": -1}).startswith("budget_mb: -1 is below its minimum (give 0 or more)")


def test_valid_inputs_pass():
    for values in (VALID, {"tile": 0, "overlap": 64, "budget_mb": 0}, {"tile": 512, "overlap": 64, "budget_mb": 2048}):
        ((name, message),) = what_the_user_sees(values)
        assert name == "vae" and message.startswith("vae: this VAE has no weights"), "every input check passed"
    assert SDOptTiledVAE.VALIDATE_INPUTS(tile=None) is True


def test_a_call_with_keywords_runs_the_vae_untiled_and_says_so():
    class ChunkingVAE:
        """A VAE that chunks its own input and output: ComfyUI calls it with ``device=``."""

        def encode(self, pixels, device=None):
            return ("encoded", pixels, device)

        def decode(self, z, device=None):
            return ("decoded", z, device)

    calls = []
    stand_in = _TilingAutoencoder(ChunkingVAE(), TiledVAEConfig(), calls)
    assert stand_in.encode("pixels", device="cpu") == ("encoded", "pixels", "cpu")
    assert stand_in.decode("z", device="cpu") == ("decoded", "z", "cpu")
    assert calls == [f"{kind}: untiled, ComfyUI called it with device=, the call of a VAE that chunks its own input and output"
                     for kind in ("encode", "decode")]
