"""ComfyUI's UNetModel as the step cache sees it: ``ComfyUNetBlocks``, the host's side of
``optim.step_cache.UNetBlocks`` (embed, down, middle, up, head), in ComfyUI's order and with its options."""
from __future__ import annotations

import torch


class ComfyUNetBlocks:
    """ComfyUI's UNetModel as the step cache's ``UNetBlocks``: the same calls, in the same order,
    with the same transformer options as its ``_forward`` without control or patches (the fast path
    runs those calls eagerly)."""

    def __init__(self, unet, transformer_options: dict):
        from comfy.ldm.modules.diffusionmodules import openaimodel

        self.unet, self.options, self.host = unet, transformer_options, openaimodel
        self.depth = len(unet.input_blocks)

    def _block(self, module, h, emb, context, output_shape=None):
        return self.host.forward_timestep_embed(module, h, emb, context, self.options, output_shape,
                                                num_video_frames=getattr(self.unet, "default_num_video_frames", None))

    def embed(self, x, timesteps, y):
        unet = self.unet
        self.options["original_shape"] = list(x.shape)
        self.options["transformer_index"] = 0
        emb = unet.time_embed(self.host.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
        return emb if unet.num_classes is None else emb + unet.label_emb(y)

    def down(self, index, h, emb, context):
        self.options["block"] = ("input", index)
        return self._block(self.unet.input_blocks[index], h, emb, context)

    def middle(self, h, emb, context):
        self.options["block"] = ("middle", 0)
        return h if self.unet.middle_block is None else self._block(self.unet.middle_block, h, emb, context)

    def up(self, index, h, skip, emb, context, output_shape):
        self.options["block"] = ("output", index)
        return self._block(self.unet.output_blocks[index], torch.cat([h, skip], dim=1), emb, context, output_shape)

    def head(self, h, x):
        h = h.type(x.dtype)
        return self.unet.id_predictor(h) if self.unet.predict_codebook_ids else self.unet.out(h)


def comfy_unet_blocks(unet, transformer_options: dict | None = None) -> ComfyUNetBlocks | None:
    """``unet`` seen as the step cache's blocks, or None where it is not ComfyUI's UNetModel layout
    (as many down as up blocks, a time embedding, an output head)."""
    layout = ("input_blocks", "middle_block", "output_blocks", "time_embed", "out", "model_channels")
    if not all(hasattr(unet, name) for name in layout) or len(unet.input_blocks) != len(unet.output_blocks):
        return None
    return ComfyUNetBlocks(unet, {} if transformer_options is None else transformer_options)
