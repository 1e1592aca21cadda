"""Noise-rescaled rectified flow (pixdit.flow) on cases with known answers.

Gaussian data x0 ~ N(mu, c^2) (per element) gives a closed-form velocity field: with a = 1 - sigma, b = sigma * s,
x_sigma ~ N(a mu, V), V = a^2 c^2 + b^2, and E[s eps - x0 | x_sigma = x] = (s b - a c^2) / V * (x - a mu) - mu.
Run: .venv/bin/python -m pytest tests/test_flow.py
"""

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.flow import SAMPLERS, RectifiedFlow, auto_noise_scale
from pixdit.models import build_model


def gaussian_velocity(mu, c, s):
    def velocity(x, t, y=None):
        sigma = (t.double() / 1000).reshape(-1, *([1] * (x.ndim - 1)))
        a, b = 1 - sigma, sigma * s
        variance = a**2 * c**2 + b**2
        return ((s * b - a * c**2) / variance * (x.double() - a * mu) - mu).float()

    return velocity


def standard_noise(shape, seed=0):
    """Noise with sample mean exactly 0 and std exactly 1, so the affine Euler map's output statistics are exact."""
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ((noise - noise.mean()) / noise.std(unbiased=False)).float()


@pytest.mark.parametrize("image_size,mu,c", [(128, 0.3, 0.5), (32, -0.2, 0.8)])
def test_euler_with_exact_field_reproduces_gaussian_data(image_size, mu, c):
    flow = RectifiedFlow(noise_scale="auto", image_size=image_size)
    velocity = gaussian_velocity(mu, c, flow.noise_scale)
    noise = standard_noise((512, 3, 4, 4))
    errors = []
    for steps in [5, 20, 80, 320]:
        x = flow.sample(velocity, noise, steps=steps, clamp=False).double()
        mean, std = x.mean().item(), x.std(unbiased=False).item()
        errors.append(abs(mean - mu) + abs(std - c))
    # Euler is first order: 4x the steps -> about 1/4 of the error, and the error goes to zero.
    assert all(3.0 < earlier / later < 5.0 for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 5e-3, errors


def test_point_mass_is_recovered_exactly_in_few_steps():
    """c = 0: every path is a straight line with constant velocity, so Euler is exact for any number of steps."""
    flow = RectifiedFlow(noise_scale=2.0)
    x = flow.sample(gaussian_velocity(0.25, 0.0, 2.0), torch.randn(4, 3, 2, 2), steps=3, clamp=False)
    torch.testing.assert_close(x, torch.full_like(x, 0.25), atol=1e-5, rtol=0)


def test_interpolant_and_target_identities():
    flow = RectifiedFlow(noise_scale=3.0)
    x0, noise = torch.rand(2, 3, 4, 4) * 2 - 1, torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(flow.interpolate(x0, noise, torch.zeros(2)), x0)
    torch.testing.assert_close(flow.interpolate(x0, noise, torch.ones(2)), 3.0 * noise)
    sigma, h = torch.tensor([0.3, 0.7]), 1e-3
    derivative = (flow.interpolate(x0, noise, sigma + h) - flow.interpolate(x0, noise, sigma - h)) / (2 * h)
    torch.testing.assert_close(derivative, flow.velocity_target(x0, noise), atol=1e-3, rtol=1e-3)


def test_loss_of_exact_field_is_the_conditional_variance():
    """The exact field minimises the loss; its value is Var(s eps - x0 | x_sigma) = s^2 + c^2 - (s b - a c^2)^2 / V."""
    mu, c, s, sigma = 0.1, 0.6, 2.0, 0.4
    flow = RectifiedFlow(noise_scale=s)
    g = torch.Generator().manual_seed(1)
    x0 = mu + c * torch.randn(4000, 3, 4, 4, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    a, b = 1 - sigma, sigma * s
    expected = s**2 + c**2 - (s * b - a * c**2) ** 2 / (a**2 * c**2 + b**2)
    exact = gaussian_velocity(mu, c, s)
    loss = flow.loss(exact, x0, noise=noise, sigma=sigma)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert abs(loss.item() - expected) < 0.02 * expected
    worse = flow.loss(lambda x, t, y: exact(x, t) + 0.1, x0, noise=noise, sigma=sigma)
    assert worse > loss


def test_loss_passes_t_equal_1000_sigma_and_labels():
    flow = RectifiedFlow(noise_scale=1.0)
    seen = {}

    def model(x, t, y):
        seen.update(t=t, y=y)
        return torch.zeros_like(x)

    x0, noise, y = torch.rand(3, 3, 2, 2), torch.randn(3, 3, 2, 2), torch.tensor([1, 2, 3])
    loss = flow.loss(model, x0, y=y, noise=noise, sigma=torch.tensor([0.1, 0.5, 1.0]))
    torch.testing.assert_close(seen["t"], torch.tensor([100.0, 500.0, 1000.0]))
    assert seen["y"] is y
    torch.testing.assert_close(loss, (noise - x0).square().mean())  # zero prediction: loss = mean(target^2)
    assert flow.loss(model, x0, noise=noise, sigma=0.5) == flow.loss(model, x0, noise=noise, sigma=0.5)


@pytest.mark.parametrize(
    "size,scale",
    [(16, 1.0), (32, 1.0), (64, 1.0), (128, 2.0), (256, 4.0), (512, 8.0), ((128, 128), 2.0), ((64, 256), 2.0)],
)
def test_auto_noise_scale(size, scale):
    assert auto_noise_scale(size) == scale
    assert RectifiedFlow(noise_scale="auto", image_size=size).noise_scale == scale


def test_timestep_distributions():
    g = torch.Generator().manual_seed(0)
    uniform = RectifiedFlow(noise_scale=1.0).sample_sigma(100_000, generator=g)
    grid = uniform * 1000
    torch.testing.assert_close(grid, grid.round())  # on the 0.001 grid
    assert uniform.min() == 0.001 and uniform.max() == 1.0 and abs(uniform.mean() - 0.5005) < 0.005
    logit = RectifiedFlow(noise_scale=1.0, timestep_sampling="logit_normal").sample_sigma(100_000, generator=g)
    assert 0 < logit.min() and logit.max() < 1 and abs(logit.median() - 0.5) < 0.01
    shifted_flow = RectifiedFlow(noise_scale=1.0, timestep_sampling="shift", shift="auto", image_size=256)
    assert shifted_flow.shift == 4.0
    shifted = shifted_flow.sample_sigma(100_000, generator=g)
    assert shifted.min() > 0 and shifted.max() <= 1.0 and shifted.mean() > 0.7  # mass moved towards noise
    sigmas = shifted_flow.sampling_sigmas(4)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas[1:] < sigmas[:-1]).all()


def test_sampling_sigmas_match_reference():
    sigmas = RectifiedFlow(noise_scale=1.0).sampling_sigmas(20)
    expected = torch.cat([torch.linspace(1.0, 0.001, 20), torch.zeros(1)])
    torch.testing.assert_close(sigmas, expected)


def test_cfg_sampling_with_dit():
    torch.manual_seed(0)
    flow = RectifiedFlow(noise_scale="auto", image_size=8)
    model = build_model("DiT-T", input_size=8, num_classes=3, zero_init=False).eval()
    noise, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 2])
    guided = flow.sample(model, noise, steps=2, y=y, cfg_scale=3.0)
    assert guided.shape == noise.shape and guided.abs().max() <= 1
    plain = flow.sample(model, noise, steps=2, y=y)
    assert not torch.allclose(guided, plain)
    torch.testing.assert_close(flow.sample(model, noise, steps=2, y=y, cfg_scale=1.0), plain)
    with pytest.raises(PixditError, match="cfg_scale"):
        flow.sample(model, noise, steps=2, cfg_scale=3.0)


@pytest.mark.parametrize("s,mu,c", [(1.0, 0.3, 0.5), (2.0, -0.2, 0.8)])
def test_heun_is_second_order_and_euler_first_order(s, mu, c):
    """Gaussian data: the ODE is linear with the exact solution x(0) = mu + c * eps from x(1) = s * eps, so the
    error of each sampler is known exactly. Going from 10 to 20 steps shrinks the step by 2.1x (the grid is
    linspace(1, 0.001, steps)): a first-order error falls ~2x, a second-order one ~4x."""
    flow = RectifiedFlow(noise_scale=s)
    velocity = gaussian_velocity(mu, c, s)
    noise = torch.randn(64, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    exact = mu + c * noise.double()

    def error(sampler, steps):
        return (flow.sample(velocity, noise, steps=steps, clamp=False, sampler=sampler).double() - exact).abs().max()

    euler10, euler20, heun10, heun20 = error("euler", 10), error("euler", 20), error("heun", 10), error("heun", 20)
    assert heun10 < euler10 / 20, (heun10, euler10)
    assert 1.7 < euler10 / euler20 < 2.4, (euler10, euler20)  # order ~1
    assert 3.3 < heun10 / heun20 < 5.0, (heun10, heun20)  # order ~2


def counting_model(record):
    """A velocity field that records (sigma, guided) for every evaluation; zero velocity."""

    class Model:
        def __call__(self, x, t, y=None):
            record.append((round(t[0].item() / 1000, 6), False))
            return torch.zeros_like(x)

        def forward_with_cfg(self, x, t, y, cfg_scale):
            record.append((round(t[0].item() / 1000, 6), True))
            return torch.zeros_like(x)

    return Model()


def test_heun_evaluates_twice_per_step_except_the_last_euler_step_to_zero():
    calls = []
    RectifiedFlow(noise_scale=1.0).sample(counting_model(calls), torch.randn(2, 3, 2, 2), steps=4, sampler="heun")
    sigmas = [sigma for sigma, _ in calls]
    assert len(calls) == 2 * 4 - 1
    # predictor at sigma_k, corrector at sigma_{k+1}; the step from 0.001 to 0 has no corrector (no evaluation at 0)
    assert sigmas == [1.0, 0.667, 0.667, 0.334, 0.334, 0.001, 0.001]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_cfg_interval_guides_only_inside_the_closed_sigma_interval(sampler):
    calls = []
    flow = RectifiedFlow(noise_scale=1.0)
    noise, y = torch.randn(2, 3, 2, 2), torch.tensor([0, 1])
    # steps=5: sigma = 1, 0.75025, 0.5005, 0.25075, 0.001; the interval's ends are sampled sigmas (closed: included)
    flow.sample(
        counting_model(calls), noise, steps=5, y=y, cfg_scale=2.0, sampler=sampler, cfg_interval=(0.25075, 0.75025)
    )
    assert calls and all(guided == (0.25075 <= sigma <= 0.75025) for sigma, guided in calls), calls
    assert {sigma for sigma, guided in calls if guided} == {0.75025, 0.5005, 0.25075}
    calls.clear()
    flow.sample(counting_model(calls), noise, steps=5, y=y, cfg_scale=2.0, sampler=sampler)  # no interval: always
    assert all(guided for _, guided in calls)
    calls.clear()
    flow.sample(counting_model(calls), noise, steps=5, y=y, cfg_scale=1.0, sampler=sampler, cfg_interval=(0.0, 1.0))
    assert not any(guided for _, guided in calls)  # scale 1: never guided


def test_bad_sampler_or_interval_is_named_before_any_model_evaluation():
    calls = []
    flow = RectifiedFlow(noise_scale=1.0)
    with pytest.raises(PixditError, match="sampler='dpm'.*allowed: euler, heun"):
        flow.sample(counting_model(calls), torch.randn(1, 3, 2, 2), steps=2, sampler="dpm")
    for bad in [(0.5, 0.2), (0.0, 1.5), "x", (0.1,)]:
        with pytest.raises(PixditError, match="cfg_interval"):
            flow.sample(counting_model(calls), torch.randn(1, 3, 2, 2), steps=2, cfg_interval=bad)
    assert calls == []


def test_bad_settings_name_the_allowed_values():
    with pytest.raises(PixditError, match="uniform, logit_normal, shift"):
        RectifiedFlow(noise_scale=1.0, timestep_sampling="cosine")
    with pytest.raises(PixditError, match="image_size"):
        RectifiedFlow(noise_scale="auto")
    with pytest.raises(PixditError, match="noise_scale"):
        RectifiedFlow(noise_scale="big")
