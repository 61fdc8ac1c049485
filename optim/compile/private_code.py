"""Each compiled model's private code copy, and freeing what torch keeps of it once the model is
gone: dynamo's compiled entries and guards per code object, a dynamic compile's ``ShapeEnv``, and
torch.fx's generated graph sources."""
from __future__ import annotations

import gc
import itertools
import linecache
import types
import weakref

_private_code_ids = itertools.count(1)


def with_private_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` over a private copy of its code object, renamed so that it is neither the same object
    nor equal to the original, which dynamo's per-code bookkeeping (compiled entries, recompile
    limit, guard failures) would otherwise share. (A ``functools.partial`` would not do: torch
    compiles it through one wrapper function of its own, shared by every partial in the process.)"""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__sdopt{next(_private_code_ids)}")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


_released = False  # whether a compiled model went since the last sweep of its guards' finalizers


def release_compiled_code(codes: tuple[types.CodeType, ...]) -> None:
    """Drop what dynamo keeps for ``codes`` (private code objects of a compiled model that is gone):
    their compiled entries, and with them the graphs and the globals dynamo installed for them.
    The entries live in the code objects' extra state, which the garbage collector does not see,
    and they hold the code objects alive in turn, so without this every compiled model's graphs
    stay in the process for good. Their guards go at the next ``sweep_dead_guards``: this may run
    inside any allocation, even in the middle of a compile."""
    global _released
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo.utils import guard_failures

    for code in codes:
        reset_code(code)
        guard_failures.pop(code, None)
    _released = True


def sweep_dead_guards() -> None:
    """Detach the finalizers that keep the guards of dropped compiled entries alive, and free what
    torch keeps of finished compiles (``_free_finished_compile_state``). Dynamo puts a
    ``weakref.finalize`` on every object a guard matches by identity (classes, modules, functions
    that live as long as the process) to invalidate the guard's entry should the object go; once
    the entry is gone the callback does nothing but hold the guards (some 15 MiB per compiled UNet).
    Only between compiles: its callers call it outside any compiled call, and it holds dynamo's
    compile lock, so no guard is half built; nothing on a torch whose guards are kept otherwise."""
    global _released
    if not _released:
        return
    try:
        from torch._dynamo.convert_frame import compile_lock
        from torch._dynamo.guards import CheckFunctionManager
    except ImportError:
        return
    with compile_lock:
        _released = False
        for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
            manager = getattr(getattr(getattr(info, "func", None), "func", None), "__self__", None)  # partial(manager.invalidate, …)
            if type(manager) is CheckFunctionManager and getattr(manager.guard_manager, "cache_entry", True) is None:
                finalizer.detach()
        _free_finished_compile_state()


def _free_finished_compile_state() -> None:
    """Free what torch keeps of finished compiles for the life of the process.

    - A dynamic-shape compile leaves its ``ShapeEnv`` in a cycle the garbage collector cannot see
      through: its ``tracked_fakes`` hold fake tensors whose symbolic sizes (C++ objects) hold the
      ``ShapeEnv`` again; and ``ShapeEnv``'s memoized methods keep every instance they saw as a key.
      Regional compile, dynamic by default, left 29 of them with their graphs for every SDXL model a
      server compiled. ``tracked_fakes`` serve only to build a compile's guards, and no compile runs
      while dynamo's compile lock is held, so both go.
    - torch.fx keeps the generated source of every graph module it ever made, for tracebacks, under
      the file name its code was compiled with (some 4 MiB per whole-model compile of the SDXL mini);
      the source of graphs no live function or frame runs goes."""
    from torch.fx import graph_module
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    live_files = set()
    for candidate in gc.get_objects():
        if type(candidate) is ShapeEnv and getattr(candidate, "tracked_fakes", None) is not None:
            candidate.tracked_fakes = None
        elif type(candidate) is types.FunctionType:
            live_files.add(candidate.__code__.co_filename)
        elif type(candidate) is types.FrameType:
            live_files.add(candidate.f_code.co_filename)
    for member in vars(ShapeEnv).values():
        if hasattr(member, "cache_clear"):
            member.cache_clear()
    sources = getattr(getattr(graph_module, "_loader", None), "eval_cache", None)
    if isinstance(sources, dict):
        for name in [name for name in sources if name not in live_files]:
            sources.pop(name, None)
            linecache.cache.pop(name, None)
