"""The GPU node tests' ComfyUI host with the full SD1.5 checkpoint (fp16) and the test prompt's conditioning."""
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def comfy():
    """(host, model, positive, negative) of the full SD1.5 checkpoint in the ComfyUI at COMFYUI_PATH."""
    comfyui = os.environ.get("COMFYUI_PATH")
    if not comfyui:
        pytest.skip("the node tests run inside ComfyUI: set COMFYUI_PATH")
    from sdopt.tools.bench_unet import checkpoint_path
    from sdopt.tools.headless import boot

    host = boot(comfyui)
    import comfy.sd
    import nodes

    path = checkpoint_path("full", Path(host.path) / "models")
    model, clip, *_ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=True)
    encode = nodes.CLIPTextEncode().encode
    return host, model, encode(clip, "a lighthouse on a cliff")[0], encode(clip, "")[0]
