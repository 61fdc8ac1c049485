"""The plan tests' shared helper: a command's input error, read as the one line the CLI prints."""
import pytest

from sdopt.tools.cli import main


@pytest.fixture
def one_line_error(capsys):
    """``one_line_error(argv)``: the error ``python -m sdopt *argv`` prints, checked to be one line with exit status 2."""
    def error(argv) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("sdopt: error: ") and err.count("\n") == 1, err
        return err

    return error
