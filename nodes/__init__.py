"""ComfyUI adapters: the node classes and the host wiring they share.

Node registrations live in ``registry.py`` (add new nodes to its ``_NODES``). They are
imported on first access, because node modules import ComfyUI at module level while
``headless`` must be importable before it boots ComfyUI.
"""


def __getattr__(name):
    if name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(name)
