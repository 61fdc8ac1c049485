"""tools.fresh_process: a real child interpreter gets the spec and the added environment, its last
stdout line is the result whatever it printed before, and a failing child's error names the
measurement and keeps the child's traceback."""
import os
import sys
import textwrap

import pytest

from sdopt.tools.fresh_process import run_in_fresh_process

CHILD = textwrap.dedent("""
    import os, sys
    from sdopt.tools.fresh_process import serve_child

    def measure(spec):
        if spec.get("fail"):
            raise ValueError("the child's own failure")
        print("a log line a library printed")
        return {"doubled": spec["x"] * 2, "mark": os.environ.get("SDOPT_TEST_MARK"), "pid": os.getpid()}

    serve_child(measure)
""")


@pytest.fixture
def child_env(tmp_path):
    (tmp_path / "sdopt_child_module.py").write_text(CHILD)
    path = os.pathsep.join(filter(None, [str(tmp_path), *sys.path]))
    return {"PYTHONPATH": path, "SDOPT_TEST_MARK": "set"}


def test_the_child_gets_the_spec_and_the_environment_and_returns_its_last_line(child_env):
    result = run_in_fresh_process("sdopt_child_module", {"x": 21}, "doubling", env=child_env)
    assert result["doubled"] == 42 and result["mark"] == "set"
    assert result["pid"] != os.getpid()
    assert "SDOPT_TEST_MARK" not in os.environ, "this process's environment is left as it was"


def test_a_failing_child_names_the_measurement_and_keeps_its_traceback(child_env):
    with pytest.raises(RuntimeError, match=r"doubling failed \(exit 1\)") as failed:
        run_in_fresh_process("sdopt_child_module", {"x": 1, "fail": True}, "doubling", env=child_env)
    assert "the child's own failure" in str(failed.value)
