"""Reference models trained here: a procedural captioned dataset of 64x64 pixel-art scenes (``scenes``),
and the attribute classifier that reads a scene back from an image (``classifier``)."""
