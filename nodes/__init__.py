"""ComfyUI faces: one small module per technique; ``glue`` (patching ComfyUI's objects), ``prompt_context``
(the per-prompt context) and ``fast_path`` (the chain of UNet-forward techniques) for what they share;
``registry`` listing them.

The registrations are imported on first access, so that importing the pack never imports ComfyUI.
"""


def __getattr__(name):
    if name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(name)
