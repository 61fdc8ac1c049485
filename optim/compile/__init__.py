"""Compiled forwards: ``torch.compile`` whole or by repeated block, or ``torch.jit.trace``.

``compile_forward(module, call, CompileConfig(...))`` returns a ``CompiledForward`` whose
``__call__(*tensors)`` equals ``call(module, *tensors)``; ``ArtifactCache`` keeps what torch compiled
for later processes. One subject per module:

- ``modes``: the three modes as objects (``CompileMode``, ``MODE_OBJECTS``): whether each can run
  here, how it sets up and runs a compiled forward, its wording in the settings and the record;
- ``config``: the settings (``CompileConfig``, whose ``kind`` is its mode's object) and why a setting
  cannot run here (``unavailable``);
- ``forward``: ``CompiledForward``, each input signature's first call eager, speed trials on a CPU;
- ``accounting``: what torch did for a compiled model: compilations, recompile reasons, graph
  breaks, the functions it gave up on, graphs another compile made;
- ``private_code``: each compiled model's private code copy, and freeing what torch keeps of it
  once the model is gone;
- ``cache``: sdopt's compile cache folders, where torch's own compiler caches are routed.
"""
from .accounting import EAGER_FRAME_FIX, GRAPH_BREAK_FIX, RECOMPILE_LIMIT_FIX, CompileStats, GaveUp, accounted, note_metric
from .cache import ArtifactCache, cache_entries, default_cache_dir, foreign_items, purge_cache, users_cache_dirs
from .config import BACKENDS, COMPILE_MODES, CompileConfig, nchw_conv_weight_bytes, unavailable
from .forward import CompiledForward, SpeedTrial, compile_forward, graph_break_reasons, isolated_recompiles
from .modes import MODE_OBJECTS, MODES, CompileMode, repeated_blocks
from .private_code import sweep_dead_guards, with_private_code

__all__ = [
    "ArtifactCache", "BACKENDS", "COMPILE_MODES", "CompileConfig", "CompileMode", "CompileStats", "CompiledForward",
    "EAGER_FRAME_FIX", "GRAPH_BREAK_FIX", "GaveUp", "MODES", "MODE_OBJECTS", "RECOMPILE_LIMIT_FIX", "SpeedTrial", "accounted",
    "cache_entries", "compile_forward", "default_cache_dir", "foreign_items", "graph_break_reasons", "isolated_recompiles",
    "nchw_conv_weight_bytes", "note_metric", "purge_cache", "repeated_blocks", "sweep_dead_guards", "unavailable",
    "users_cache_dirs", "with_private_code",
]
