"""Patched VAE copies, shared by the VAE nodes.

ComfyUI has no ``VAE.clone()``: a VAE node returns a shallow copy whose decode/encode
(tiled too) run through a wrapper. Every wrapper is bound to the copy and calls what it
wraps with that same ``self``, so a copy of a patched copy (the next VAE node, or a copy
with converted weights) runs the whole chain on its own weights and blocks.
"""
from __future__ import annotations

import copy
import types

VAE_METHODS = ("decode", "encode", "decode_tiled", "encode_tiled")


def copy_vae(vae):
    """A shallow copy whose methods bound to ``vae`` (an earlier node's wrapper) are bound to the copy."""
    duplicate = copy.copy(vae)
    for name, value in vars(vae).items():
        if isinstance(value, types.MethodType) and value.__self__ is vae:
            setattr(duplicate, name, types.MethodType(value.__func__, duplicate))
    return duplicate


def wrap_vae_methods(vae, wrap):
    """A copy of ``vae`` whose decode/encode methods are ``wrap(name, inner)``.

    ``inner(self, *args, **kwargs)`` is what the method did before (ComfyUI's own, or an
    earlier wrapper); ``wrap`` returns a function of the same form.
    """
    patched = copy_vae(vae)
    for name in VAE_METHODS:
        method = getattr(vae, name, None)
        if method is not None:
            setattr(patched, name, types.MethodType(wrap(name, method.__func__), patched))
    return patched
