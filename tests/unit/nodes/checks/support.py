"""What the doctor's check tests share: a context on the CPU, the one row of a check, a row short of ok with
its fix, and a trial that raises."""
import torch

from sdopt.nodes.checks import FAILED, OK, Context

CPU = torch.device("cpu")


def ctx(comfyui=None) -> Context:
    return Context(CPU, comfyui)


def one(rows, check):
    (row,) = [r for r in rows if r.check == check]
    return row


def assert_fix(row, *words):
    assert row.status != OK and row.fix, row
    for word in words:
        assert word in row.fix, (word, row.fix)


def raising(message: str, error: type[Exception] = RuntimeError):
    """A stand-in for a trial or a check, whatever it is given, that raises ``error(message)``."""
    def trial(*args, **kwargs):
        raise error(message)

    return trial


def assert_failed(row, says: str, *fix_words):
    """``row`` failed, its result says ``says`` and its fix names ``fix_words``."""
    assert row.status == FAILED and says in row.result, row
    assert_fix(row, *fix_words)
