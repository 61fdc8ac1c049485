"""Tiled VAE decode and encode whose output matches the untiled one: GroupNorm over the whole image.

Host-independent: works on the autoencoder module it is given (ComfyUI's/LDM's ``AutoencoderKL``
or ``AutoencodingEngine``, or diffusers' ``AutoencoderKL``) by walking its known structure, never
changing it. ``tiled_decode``/``tiled_encode`` with a frozen ``TiledVAEConfig`` return the output
and ``TilingStats`` (tile used, tiles, passes, out-of-memory retries, values stored wide).

The network is rewritten as a small graph of tileable steps plus whole-tensor steps (the mid-block
attention at latent size), and run layer-synchronously, one pass over all tiles per GroupNorm, so
every tile is normalized with the whole image's statistics. One module per subject:

- ``config``: settings, their validation, what a call did;
- ``graph``: the step graph and the regions its steps need;
- ``adapters``: per VAE architecture (``Family.vae_layout``), how its modules become a step graph;
  new VAE families land here;
- ``execution``: passes, tile grid, statistics, what is kept between passes, the memory model;
- ``tiling``: the verbs, auto tile size, only-when-needed and out-of-memory retries.
"""
from .adapters import ADAPTERS, ARCHITECTURES, LDM_AUTOENCODER_KL, VAEAdapter, adapter_for
from .config import (
    DECODE,
    ENCODE,
    MIN_TILE,
    TILE_STEP,
    TiledResult,
    TiledVAEConfig,
    TilingStats,
    UnsupportedVAE,
    check_overlap,
    check_tile,
    check_tile_inputs,
)
from .tiling import tiled_decode, tiled_encode, unsupported_reason

__all__ = [
    "ADAPTERS", "ARCHITECTURES", "DECODE", "ENCODE", "LDM_AUTOENCODER_KL", "MIN_TILE", "TILE_STEP", "TiledResult",
    "TiledVAEConfig", "TilingStats", "UnsupportedVAE", "VAEAdapter", "adapter_for", "check_overlap", "check_tile",
    "check_tile_inputs", "tiled_decode", "tiled_encode", "unsupported_reason",
]
