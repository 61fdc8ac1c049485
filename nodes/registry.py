"""Every node class of the pack with its display name: add new nodes to ``_NODES``."""
from .attention import SDOptAttention
from .auto import SDOptAuto
from .compile import SDOptCompile
from .cuda_graph import SDOptCUDAGraph
from .doctor import SDOptDoctor
from .lowmem import SDOptLowMemory
from .offload import SDOptOffload
from .precision import SDOptPrecision
from .profiler import SDOptProfiler
from .report import SDOptProfileReport
from .step_cache import SDOptStepCache
from .tiled_vae import SDOptTiledVAE
from .vae_attention import SDOptVAEAttention
from .vae_precision import SDOptVAEPrecision

_NODES = {
    "SDOptAuto": (SDOptAuto, "sdopt Auto"),
    "SDOptProfiler": (SDOptProfiler, "sdopt Profiler"),
    "SDOptProfileReport": (SDOptProfileReport, "sdopt Profile Report"),
    "SDOptPrecision": (SDOptPrecision, "sdopt Precision"),
    "SDOptVAEPrecision": (SDOptVAEPrecision, "sdopt VAE Precision"),
    "SDOptAttention": (SDOptAttention, "sdopt Attention"),
    "SDOptVAEAttention": (SDOptVAEAttention, "sdopt VAE Attention"),
    "SDOptTiledVAE": (SDOptTiledVAE, "sdopt Tiled VAE"),
    "SDOptCompile": (SDOptCompile, "sdopt Compile"),
    "SDOptCUDAGraph": (SDOptCUDAGraph, "sdopt CUDA Graph"),
    "SDOptStepCache": (SDOptStepCache, "sdopt Step Cache"),
    "SDOptLowMemory": (SDOptLowMemory, "sdopt Low Memory"),
    "SDOptOffload": (SDOptOffload, "sdopt Offload"),
    "SDOptDoctor": (SDOptDoctor, "sdopt Doctor"),
}

NODE_CLASS_MAPPINGS = {name: cls for name, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: title for name, (_, title) in _NODES.items()}
