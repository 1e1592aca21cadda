"""Noise-rescaled rectified flow (docs/algorithms.md): the training loss, timestep sampling and the Euler sampler.

With data x0 in [-1, 1], Gaussian noise eps and a noise scale s (the paper's "noise rescaling"):

    x_sigma = (1 - sigma) * x0 + sigma * s * eps          sigma in (0, 1]; the model sees t = 1000 * sigma
    target  = s * eps - x0                                 d x_sigma / d sigma: the velocity, pointing noise-ward
    loss    = mean((model(x_sigma, t) - target)^2)         in fp32, uniform weight

`noise_scale="auto"` sets s = side / 64 (1 for images of 64 px or less; side = sqrt(H * W)), which keeps the
signal-to-noise ratio of a 64-px image at higher resolutions (128 px -> s = 2, 256 px -> s = 4).

Timestep sampling (`timestep_sampling`):
  uniform       sigma in {0.001, 0.002, ..., 1.000}, as the reference trainer (sigma = 0 is never drawn)
  logit_normal  sigma = sigmoid(logit_normal_mean + logit_normal_std * n), n ~ N(0, 1) (SD3)
  shift         uniform sigma, then sigma -> shift * sigma / (1 + (shift - 1) * sigma) (SD3's resolution shift;
                shift="auto" = side / 64 (1 up to 64 px, like noise_scale="auto"), which matches the SNR of noise
                rescaling, so use it with noise_scale=1).
                The sampler uses the same shifted schedule.

Sampling (Euler, deterministic): x = s * eps, sigma_k = linspace(1, 0.001, steps) then 0,
x <- x + (sigma_{k+1} - sigma_k) * v(x, 1000 * sigma_k), updates in fp32, classifier-free guidance if cfg_scale != 1.

    >>> flow = RectifiedFlow(noise_scale="auto", image_size=128)
    >>> loss = flow.loss(model, images)                          # training
    >>> images = flow.sample(ema_model, torch.randn(16, 3, 128, 128, generator=g), steps=20)

Tests: ``.venv/bin/python -m pytest tests/test_flow.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pixdit.errors import PixditError

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "shift")
NUM_TRAIN_TIMESTEPS = 1000  # t = 1000 * sigma; uniform sigma lives on the grid 1/1000, ..., 1000/1000
MIN_SAMPLING_SIGMA = 0.001  # the sampler's last model evaluation, as the reference


def auto_noise_scale(image_size: int | tuple[int, int]) -> float:
    """side / 64 with side = sqrt(H * W); 1 for images of 64 px or less."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    return max(1.0, math.sqrt(height * width) / 64)


class RectifiedFlow:
    """Training and sampling maths of noise-rescaled rectified flow; see the module docstring."""

    def __init__(
        self,
        noise_scale: float | str = "auto",
        image_size: int | tuple[int, int] | None = None,
        timestep_sampling: str = "uniform",
        logit_normal_mean: float = 0.0,
        logit_normal_std: float = 1.0,
        shift: float | str = "auto",
    ):
        if timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise PixditError(f"timestep_sampling={timestep_sampling!r} is not known; allowed values: "
                              f"{', '.join(TIMESTEP_SAMPLINGS)}")
        self.noise_scale = self._resolve("noise_scale", noise_scale, image_size)
        self.timestep_sampling = timestep_sampling
        self.logit_normal_mean = float(logit_normal_mean)
        self.logit_normal_std = float(logit_normal_std)
        self.shift = self._resolve("shift", shift, image_size) if timestep_sampling == "shift" else 1.0

    @staticmethod
    def _resolve(name: str, value, image_size) -> float:
        if value == "auto":
            if image_size is None:
                raise PixditError(f"{name}='auto' needs image_size (the data resolution)")
            return auto_noise_scale(image_size)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise PixditError(f"{name}={value!r} must be 'auto' or a positive number") from None
        if not value > 0:
            raise PixditError(f"{name}={value} must be 'auto' or a positive number")
        return value

    def __repr__(self) -> str:
        return (f"RectifiedFlow(noise_scale={self.noise_scale:g}, timestep_sampling={self.timestep_sampling!r}, "
                f"shift={self.shift:g})")

    # ---------------------------------------------------------- training
    def apply_shift(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.shift * sigma / (1 + (self.shift - 1) * sigma)

    def sample_sigma(self, batch_size: int, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training noise levels, fp32 [batch_size] in (0, 1]."""
        if self.timestep_sampling == "logit_normal":
            n = torch.randn(batch_size, device=device, generator=generator)
            return torch.sigmoid(self.logit_normal_mean + self.logit_normal_std * n)
        u = torch.randint(0, NUM_TRAIN_TIMESTEPS, (batch_size,), device=device, generator=generator)
        sigma = (NUM_TRAIN_TIMESTEPS - u).float() / NUM_TRAIN_TIMESTEPS
        return self.apply_shift(sigma) if self.timestep_sampling == "shift" else sigma

    def interpolate(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """x_sigma = (1 - sigma) x0 + sigma s eps (fp32); sigma: [b]."""
        sigma = _per_sample(sigma, x0)
        return (1 - sigma) * x0.float() + sigma * self.noise_scale * noise.float()

    def velocity_target(self, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """s eps - x0 (fp32): d x_sigma / d sigma."""
        return self.noise_scale * noise.float() - x0.float()

    def loss(self, model: Callable, x0: torch.Tensor, y: torch.Tensor | None = None,
             noise: torch.Tensor | None = None, sigma: torch.Tensor | float | None = None) -> torch.Tensor:
        """Mean squared velocity error (fp32 scalar). Pass `noise` and `sigma` for a deterministic (validation) loss."""
        if noise is None:
            noise = torch.randn_like(x0, dtype=torch.float32)
        if sigma is None:
            sigma = self.sample_sigma(x0.shape[0], device=x0.device)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x0.device).expand(x0.shape[0])
        x_sigma = self.interpolate(x0, noise, sigma)
        prediction = model(x_sigma, NUM_TRAIN_TIMESTEPS * sigma, y)
        return (prediction.float() - self.velocity_target(x0, noise)).square().mean()

    # ---------------------------------------------------------- sampling
    def sampling_sigmas(self, steps: int) -> torch.Tensor:
        """[steps + 1] fp32: linspace(1, 0.001, steps) (shifted for timestep_sampling=shift), then 0."""
        if steps < 1:
            raise PixditError(f"steps={steps} must be at least 1")
        sigmas = torch.linspace(1.0, MIN_SAMPLING_SIGMA, steps, dtype=torch.float64)
        if self.timestep_sampling == "shift":
            sigmas = self.apply_shift(sigmas)
        return torch.cat([sigmas, sigmas.new_zeros(1)]).float()

    @torch.no_grad()
    def sample(self, model: Callable, noise: torch.Tensor, steps: int = 20, y: torch.Tensor | None = None,
               cfg_scale: float = 1.0, clamp: bool = True) -> torch.Tensor:
        """Euler integration from x = s * noise (per-sample noise: the caller controls the seeds) to sigma = 0.
        Returns fp32 images, clamped to [-1, 1] unless clamp=False. cfg_scale != 1 needs labels `y` and a model with
        `forward_with_cfg` (pixdit.models.DiT)."""
        guided = cfg_scale != 1.0
        if guided and (y is None or not hasattr(model, "forward_with_cfg")):
            raise PixditError(f"cfg_scale={cfg_scale} needs class labels y and a class-conditional model")
        x = self.noise_scale * noise.float()
        sigmas = self.sampling_sigmas(steps).tolist()
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            t = torch.full((x.shape[0],), NUM_TRAIN_TIMESTEPS * sigma, device=x.device, dtype=torch.float32)
            velocity = model.forward_with_cfg(x, t, y, cfg_scale) if guided else model(x, t, y)
            x = x + (sigma_next - sigma) * velocity.float()
        return x.clamp(-1, 1) if clamp else x


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    return sigma.reshape(-1, *([1] * (like.ndim - 1)))
