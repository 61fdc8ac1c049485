"""nodes.inputs: one message per bad input, under its own name, for every node (each node's function
checks its values against ``INPUT_TYPES`` first: nodes.base).

ComfyUI is never imported here: every ``comfy*`` module a function imports lazily is a fake put into
``sys.modules`` for one test (comfy_fakes.py). The host tier runs the same code against real ComfyUI.
"""
import re

import pytest

from sdopt.errors import UserError
from sdopt.nodes import attention as attention_node
from sdopt.nodes import inputs

pytestmark = pytest.mark.usefixtures("no_comfyui")


def _checked_nodes():
    from sdopt.nodes.registry import NODE_CLASS_MAPPINGS

    return dict(NODE_CLASS_MAPPINGS)


def _spec(cls) -> dict:
    return {name: entry for kind, section in cls.INPUT_TYPES().items() if kind != "hidden" for name, entry in section.items()}


def _good(kind, options):
    if isinstance(kind, list):
        return options.get("default", kind[0])
    return options.get("default", {"BOOLEAN": False, "STRING": "x", "INT": 1, "FLOAT": 1.0}.get(kind))


def _bad(kind, options):
    if isinstance(kind, list):
        return "not-an-option"
    if kind in ("INT", "FLOAT"):
        return options["min"] - 1 if "min" in options else "many"
    return {"BOOLEAN": "yes", "STRING": 5}.get(kind)


CHECKED_INPUTS = [(name, input_name) for name, cls in _checked_nodes().items() for input_name, (kind, *rest) in _spec(cls).items()
                  if _bad(kind, rest[0] if rest else {}) is not None]


@pytest.mark.parametrize("node,input_name", CHECKED_INPUTS, ids=[f"{n}.{i}" for n, i in CHECKED_INPUTS])
def test_a_bad_value_gets_one_message_under_its_own_input(node, input_name):
    cls = _checked_nodes()[node]
    spec = _spec(cls)
    values = {name: _good(kind, rest[0] if rest else {}) for name, (kind, *rest) in spec.items()}
    kind, *rest = spec[input_name]
    values[input_name] = _bad(kind, rest[0] if rest else {})
    with pytest.raises(UserError) as raised:
        getattr(cls(), cls.FUNCTION)(**values)
    message = str(raised.value)
    assert message.startswith(f"{input_name}: "), message
    others = [name for name in spec if name != input_name and re.search(rf"(?<!\w){name}: ", message)]
    assert others == [], f"the message is filed under {others} too: {message}"
    assert "; " not in message, "one message"


def test_two_bad_inputs_get_a_message_each():
    with pytest.raises(UserError) as raised:
        inputs.check_inputs(attention_node.SDOptAttention, backend="fastest", on_unavailable="fallback", slice_size=-1, memory_budget_mb=0)
    assert str(raised.value) == (
        f"backend: 'fastest' is not offered (choose one of {', '.join(attention_node.attention_choices())}); "
        "slice_size: -1 is below its minimum (give 0 or more); memory_budget_mb: 0 is below its minimum (give 1 or more)"
    )


@pytest.mark.parametrize("kind,options,value,problem", [
    ("INT", {"min": 1, "max": 64}, 65, "65 is above its maximum (give 64 or less)"),
    ("INT", {}, 2.5, "2.5 is not a whole number"),
    ("INT", {}, True, "True is not a whole number"),
    ("FLOAT", {}, float("nan"), "nan is not a number"),
    ("FLOAT", {"min": 0.0}, 0.5, None),
    ("BOOLEAN", {}, 1, "1 is not true or false"),
    ("MODEL", {}, object(), None),
])
def test_input_problems(kind, options, value, problem):
    assert inputs._input_problem(kind, options, value) == problem
