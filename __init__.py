"""sdopt: ComfyUI nodes for faster, leaner Stable Diffusion inference, with a profiler.

ComfyUI imports this folder as a custom node pack; pip installs it as ``sdopt``.
The node classes are registered only when ComfyUI is the host (its ``comfy``
package is already imported), so ``import sdopt`` and the CLI work anywhere.
"""
import sys

WEB_DIRECTORY = "./web"

if "comfy" in sys.modules:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
