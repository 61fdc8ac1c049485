"""ComfyUI faces: one small module per node, on the node base (``base``), listed in ``registry``; the host glue
they share, each module named for its subject (``inputs``, ``patching``, ``private_copy``, ``environment``,
``call_rows``, ``prompt_context``, ``fast_path``, ``unet_blocks``); the doctor's checks in ``checks``.

The registrations are imported on first access, so that importing the pack never imports ComfyUI.
"""


def __getattr__(name):
    if name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(name)
