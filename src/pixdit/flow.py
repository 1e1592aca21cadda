"""Noise-rescaled rectified flow (docs/algorithms.md): the training loss, timestep sampling and the samplers.

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

Sampling (deterministic ODE solvers, `sampler=`): x = s * eps, sigma_k = linspace(1, 0.001, steps) then 0, updates in
fp32, h_k = sigma_{k+1} - sigma_k (negative: sigma runs from noise to data), v_k = v(x, 1000 * sigma_k):
  euler  x <- x + h_k v_k                                          first order, `steps` model evaluations
  heun   x' = x + h_k v_k;  x <- x + h_k (v_k + v(x', sigma_{k+1})) / 2   second order (EDM's Heun: Euler predictor,
         trapezoid corrector); the last step, to sigma = 0, is plain Euler (as EDM), so 2 * steps - 1 evaluations
Classifier-free guidance (cfg_scale != 1) is applied at every model evaluation whose sigma lies in `cfg_interval`
(None = everywhere); outside it the model gives the plain conditional velocity (see `RectifiedFlow.sample`).

    >>> flow = RectifiedFlow(noise_scale="auto", image_size=128)
    >>> loss = flow.loss(model, images)                          # training
    >>> images = flow.sample(ema_model, torch.randn(16, 3, 128, 128, generator=g), steps=20)
    >>> images = flow.sample(ema_model, noise, steps=10, sampler="heun", y=labels, cfg_scale=1.5, cfg_interval=(0.0, 0.7))

Tests: ``.venv/bin/python -m pytest tests/test_flow.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pixdit.errors import PixditError

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal", "shift")
SAMPLERS = ("euler", "heun")
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
            raise PixditError(
                f"timestep_sampling={timestep_sampling!r} is not known; allowed values: {', '.join(TIMESTEP_SAMPLINGS)}"
            )
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
        return (
            f"RectifiedFlow(noise_scale={self.noise_scale:g}, timestep_sampling={self.timestep_sampling!r}, "
            f"shift={self.shift:g})"
        )

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

    def loss(
        self,
        model: Callable,
        x0: torch.Tensor,
        y: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        sigma: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
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
    def sample(
        self,
        model: Callable,
        noise: torch.Tensor,
        steps: int = 20,
        y: torch.Tensor | None = None,
        cfg_scale: float = 1.0,
        clamp: bool = True,
        sampler: str = "euler",
        cfg_interval: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """Integrate the flow ODE from x = s * noise (per-sample noise: the caller controls the seeds) to sigma = 0.

        sampler: "euler" (first order) or "heun" (second order; see the module docstring).
        cfg_scale != 1 needs labels `y` and a model with `forward_with_cfg` (pixdit.models.DiT).
        cfg_interval: (lo, hi) in this flow's sigma (1 = pure noise, 0 = data; the model sees t = 1000 * sigma):
            guidance is applied at a model evaluation when lo <= sigma <= hi (a closed interval), elsewhere the model
            gives the conditional velocity. None = guidance at every evaluation. Papers that count time the other way
            (JiT's t = 1 - sigma, guidance for t in [0.1, 1]) correspond to cfg_interval = (1 - t_hi, 1 - t_lo).
        Returns fp32 images, clamped to [-1, 1] unless clamp=False.
        """
        interval = check_sampler(sampler, cfg_interval)
        guided = cfg_scale != 1.0
        if guided and (y is None or not hasattr(model, "forward_with_cfg")):
            raise PixditError(f"cfg_scale={cfg_scale} needs class labels y and a class-conditional model")

        def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
            t = torch.full((x.shape[0],), NUM_TRAIN_TIMESTEPS * sigma, device=x.device, dtype=torch.float32)
            if guided and (interval is None or interval[0] <= sigma <= interval[1]):
                return model.forward_with_cfg(x, t, y, cfg_scale).float()
            return model(x, t, y).float()

        x = self.noise_scale * noise.float()
        sigmas = self.sampling_sigmas(steps).tolist()
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            h = sigma_next - sigma
            v = velocity(x, sigma)
            if sampler == "heun" and sigma_next > 0:
                x_predicted = x + h * v
                x = x + h * 0.5 * (v + velocity(x_predicted, sigma_next))
            else:
                x = x + h * v
        return x.clamp(-1, 1) if clamp else x


def check_sampler(sampler: str, cfg_interval=None, prefix: str = "") -> tuple[float, float] | None:
    """Validate a sampler name and a CFG interval (cheap: call it before any expensive work); returns the interval as
    a (lo, hi) float pair or None. `prefix` is prepended to the option names in messages (e.g. "callbacks.fid.")."""
    if sampler not in SAMPLERS:
        raise PixditError(f"{prefix}sampler={sampler!r} is not known; allowed: {', '.join(SAMPLERS)}")
    if cfg_interval is None:
        return None
    try:
        lo, hi = (float(v) for v in cfg_interval)
    except (TypeError, ValueError):
        raise PixditError(
            f"{prefix}cfg_interval={cfg_interval!r} must be null or a pair [lo, hi] of noise levels "
            f"sigma in [0, 1] (1 = pure noise), e.g. [0.0, 0.7]"
        ) from None
    if not 0.0 <= lo <= hi <= 1.0:
        raise PixditError(
            f"{prefix}cfg_interval=[{lo}, {hi}] needs 0 <= lo <= hi <= 1 (sigma: 1 = pure noise, 0 = data)"
        )
    return lo, hi


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    return sigma.reshape(-1, *([1] * (like.ndim - 1)))
