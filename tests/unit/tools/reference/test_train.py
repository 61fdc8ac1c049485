"""tools.reference.train without ComfyUI: the signal-to-noise ratio read from a model sampling's own noise
and input scaling, for ComfyUI's two kinds (DDPM's epsilon and rectified flow)."""
from __future__ import annotations

import torch

from sdopt.tools.reference.train import _signal_to_noise


def _view(sigma, x):
    return sigma.view(sigma.shape[:1] + (1,) * (x.ndim - 1))


class Epsilon:
    """ComfyUI's EPS sampling: x = x0 + sigma * noise, fed to the model as x / sqrt(sigma**2 + 1)."""

    def noise_scaling(self, sigma, noise, latent_image):
        return latent_image + noise * sigma

    def calculate_input(self, sigma, x):
        return x / (_view(sigma, x) ** 2 + 1) ** 0.5


class RectifiedFlow:
    """ComfyUI's CONST sampling: x = sigma * noise + (1 - sigma) * x0, fed as it is."""

    def noise_scaling(self, sigma, noise, latent_image):
        return sigma * noise + (1 - sigma) * latent_image

    def calculate_input(self, sigma, x):
        return x


def test_the_signal_to_noise_ratio_of_each_kind_of_model_sampling():
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(_signal_to_noise(Epsilon(), sigmas), 1 / sigmas**2)
    torch.testing.assert_close(_signal_to_noise(RectifiedFlow(), sigmas), ((1 - sigmas) / sigmas) ** 2)
