"""Host-independent optimizations, profiler and benches: torch and diffusers only, never ComfyUI."""
