"""SDOptLowMemory (MODEL → MODEL): the same UNet output with less working memory per step.

Delegates to ``optim.lowmem``: an APPLY_MODEL wrapper runs each call under ``low_memory`` (chunked
GroupNorm, sliced convs and feed-forwards) and, with ``sequential_cfg``, cond and uncond one after
the other (every batched input split with them: context, SDXL's ``y``, ControlNet residuals; each
part's ``transformer_options`` describe its own rows, and the wrapper runs outside every other
APPLY_MODEL wrapper, so step caches see each part as a call of its own);
attention goes through sdopt Attention's ``low_memory`` choice: PyTorch's fused sdpa kernels (memory
linear in the tokens) where one takes the inputs, else ``sub_quadratic`` sized from the same budget. The
feed-forward modules to slice are the model family's (``families/``: by class, or by attribute name for
Flux's ``nn.Sequential`` MLPs); the record counts what can be chunked on this model and names what it lacks
(a DiT has no GroupNorm).
"""
from ..optim.attention import LOW_MEMORY
from ..optim.lowmem import LowMemConfig, chunkable, run_low_memory
from . import call_rows, environment, patching
from .attention import SDOptAttention
from .base import PatchNode

NODE = "SDOptLowMemory"


class SDOptLowMemory(PatchNode):
    DESCRIPTION = (
        "Runs the diffusion model within a working-memory budget per operation: cond and uncond in turn, chunked "
        "GroupNorm, sliced convolutions, exact linear-memory attention. Same output to float rounding; for large "
        "images where activations run out of memory."
    )

    @classmethod
    def inputs(cls):
        return {
            "budget_mb": ("INT", {"default": 256, "min": 1, "max": 1 << 20, "tooltip": "Working memory one operation may use, beyond its input and output."}),
            "sequential_cfg": ("BOOLEAN", {"default": True, "tooltip": "Run cond and uncond one after the other instead of as one batch."}),
            "chunk_ops": ("BOOLEAN", {"default": True, "tooltip": "Chunk GroupNorm and slice convolutions and feed-forwards over the budget."}),
        }

    def patch(self, model, budget_mb, sequential_cfg, chunk_ops):
        family = environment.model_family(model)
        config = LowMemConfig(budget_mb << 20, sequential_cfg, chunk_ops, chunk_ops, chunk_ops,
                              feedforward_modules=family.described.feedforward_modules)
        (m,) = SDOptAttention().patch(model, LOW_MEMORY, "fallback", 0, budget_mb)

        def low_memory_call(executor, x, *args, **kwargs):
            return run_low_memory(config, executor, x, *args, within=executor.class_obj.diffusion_model,
                                  label_part=call_rows.label_batch_rows, **kwargs)

        patching.set_wrappers(m, NODE, {"APPLY_MODEL": low_memory_call})
        # Every other APPLY_MODEL wrapper (sdopt Step Cache's, other packs') then sees each part of a
        # split batch as a call of its own, as if ComfyUI had made it, whatever the nodes' order.
        patching.make_outermost(m, NODE, "APPLY_MODEL")
        counts = chunkable(m.get_model_object("diffusion_model"), config) if chunk_ops else {}
        chunked = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        parts = [f"budget {budget_mb} MiB", f"{LOW_MEMORY} attention"] + (["sequential cfg"] if sequential_cfg else []) + (
            [f"chunked over the budget: {chunked}"] if chunked else [])
        requested = f"budget_mb={budget_mb}, sequential_cfg={sequential_cfg}, chunk_ops={chunk_ops}"
        missing = [kind for kind, n in counts.items() if not n]
        lacking = f"{family.label}'s diffusion model has no {', no '.join(missing)} to chunk" if missing else ""
        note = "; ".join(filter(None, ["attention set through sdopt Attention (its record is beside this one)", lacking,
                                       family.unknown_note]))
        short = "no feed-forwards to slice" if chunk_ops and not counts.get("feed-forwards") else ""
        patching.record_model(m, NODE, requested, ", ".join(parts), note, short)
        return (m,)
