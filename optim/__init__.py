"""Techniques only, one module per technique (its frozen config and its apply functions): torch, never ComfyUI,
the profiler or the report."""
