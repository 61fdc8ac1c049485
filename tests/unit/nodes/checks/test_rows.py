"""The doctor's rows: a row short of ok carries its fix, and a status is one of the four."""
import pytest

from sdopt.nodes.checks import OK, WARN, CheckRow


def test_a_row_short_of_ok_must_carry_its_fix():
    with pytest.raises(ValueError, match="needs a fix"):
        CheckRow("x", "tried", WARN, "result")
    with pytest.raises(ValueError, match="status"):
        CheckRow("x", "tried", "fine", "result")
    assert CheckRow("x", "tried", OK, "result").fix == ""
