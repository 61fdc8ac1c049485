"""The doctor's checks: what works on this machine, each tried with one tiny run, and the fix for what does not.
``python -m sdopt doctor`` (``tools/cli.py``) and the sdopt Doctor node (``nodes/doctor.py``) run them.

Every check runs its thing (a kernel, a cast, an attention call compared with sdpa, a compile, a
graph capture, a file written into the compile cache), never an import alone, and gives rows: what
was tried, a status, the result, and for anything short of ``ok`` the fix. The rows about sdopt's
nodes ask each technique's own ``unavailable(config, device)`` (``optim.compile``,
``optim.cuda_graph``, ``optim.offload``), the attention registry's checks and ``optim.precision``'s
probes, so they say what the nodes themselves decide here.

ComfyUI is looked at without booting it: its version file and the modules whose APIs sdopt uses
(the CLI imports them, ``tools/doctor.py``'s ``load_comfyui``); inside a running ComfyUI (the sdopt Doctor
node) the live modules are read instead, which also says whether dynamic VRAM is on. One subject per module:

- ``rows``: ``CheckRow``, ``Context`` (with ``ComfyInfo``), the helpers the checks share, the table and summary;
- ``device``: the device, torch, each dtype's storage and compute, the device a command names;
- ``kernels``: the attention backends, an inductor compile and a CUDA graph capture, each against a reference;
- ``comfyui``: ComfyUI's version, APIs, device and memory mode (whether a server would start dynamic VRAM),
  and sdopt's compile cache (``environment.server_would_start`` decides the memory mode);
- ``per_node``: what each node of ``nodes/registry.py`` would run here (``NODE_ROWS``, by class name);
- ``run``: every check in order (``CHECKS``), run on one device.
"""
from .comfyui import check_comfyui, check_compile_cache, comfyui_device, comfyui_info, default_device, read_version
from .device import check_device, check_dtypes, check_torch, usable_device
from .kernels import check_attention, check_cuda_graph, check_inductor, compile_trial
from .per_node import NODE_CHECKS, NODE_ROWS, WITHOUT_ROW, check_nodes, require_rows
from .rows import FAILED, OK, STATUSES, UNAVAILABLE, WARN, CheckRow, ComfyInfo, Context, doctor_table, first_line, summary
from .run import CHECKS, run_checks

__all__ = [
    "CHECKS", "FAILED", "NODE_CHECKS", "NODE_ROWS", "OK", "STATUSES", "UNAVAILABLE", "WARN",
    "WITHOUT_ROW", "CheckRow", "ComfyInfo", "Context", "check_attention", "check_comfyui", "check_compile_cache", "check_cuda_graph",
    "check_device", "check_dtypes", "check_inductor", "check_nodes", "check_torch", "comfyui_device", "comfyui_info", "compile_trial",
    "default_device", "doctor_table", "first_line", "read_version", "require_rows",
    "run_checks", "summary", "usable_device",
]
