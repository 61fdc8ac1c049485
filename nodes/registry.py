"""Every node class of the pack with its display name: add new nodes to ``_NODES``."""
from .profiler import SDOptProfiler, SDOptProfileReport

_NODES = {
    "SDOptProfiler": (SDOptProfiler, "sdopt Profiler"),
    "SDOptProfileReport": (SDOptProfileReport, "sdopt Profile Report"),
}

NODE_CLASS_MAPPINGS = {name: cls for name, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: title for name, (_, title) in _NODES.items()}
