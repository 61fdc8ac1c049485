"""The attention tests' fixture: test backends registered for one test, the registry restored after it."""
import pytest

from sdopt.optim.attention.backends import backend_names, get_backend, register_backend, unregister_backend


@pytest.fixture
def registered():
    """Register test backends (or replacements) and restore the registry afterwards."""
    before = {name: get_backend(name) for name in backend_names()}
    order = list(before)

    def register(backend):
        register_backend(backend, replace=True)
        return backend.name

    yield register
    for name in backend_names():
        unregister_backend(name)
    for name in order:
        register_backend(before[name])
