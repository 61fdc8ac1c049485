"""Every node class of the pack with its display name: add new nodes to ``_NODES``."""
from .attention import SDOptAttention, SDOptVAEAttention
from .precision import SDOptPrecision, SDOptVAEPrecision
from .profiler import SDOptProfiler, SDOptProfileReport

_NODES = {
    "SDOptProfiler": (SDOptProfiler, "sdopt Profiler"),
    "SDOptProfileReport": (SDOptProfileReport, "sdopt Profile Report"),
    "SDOptAttention": (SDOptAttention, "sdopt Attention"),
    "SDOptVAEAttention": (SDOptVAEAttention, "sdopt VAE Attention"),
    "SDOptPrecision": (SDOptPrecision, "sdopt Precision"),
    "SDOptVAEPrecision": (SDOptVAEPrecision, "sdopt VAE Precision"),
}

NODE_CLASS_MAPPINGS = {name: cls for name, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: title for name, (_, title) in _NODES.items()}
