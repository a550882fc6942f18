"""Sampling a flow model: an Euler ODE sampler, and Flow-GRPO's SDE sampler with log-probs.

Convention (see :mod:`trainers.diffusion.model`): ``x_t = (1 − t)·x0 + t·ε``, the model
predicts ``v = ε − x0``, and sampling walks a time grid from t = 1 (noise) to t = 0
(data), so every step ``Δt = t_next − t`` is negative.

ODE step: ``x_next = x + v·Δt``.

SDE step (Flow-GRPO, Liu et al. 2025, eq. 9), the reverse-time SDE with the same
marginals as the ODE::

    σ_t    = a·sqrt(t / (1 − t))                       a = noise_level
    mean   = x + [v + σ_t²/(2t)·(x + (1 − t)·v)]·Δt
    x_next = mean + σ_t·sqrt(|Δt|)·ε

At t = 1, ``1 − t`` is replaced by ``1 − t_1`` (the next grid time), as in the
reference implementation, so σ stays finite. Every transition is Gaussian, and its
log-density (summed over pixels) is what the policy gradient needs; a trainer
recomputes it under updated weights with :func:`step_log_prob`, one step index at a
time, on any subset of rows. At ``noise_level = 0`` the SDE sampler takes exactly the
ODE sampler's steps (same floats); its transitions then have no density and the
recorded log-probs are NaN.

Classifier-free guidance: ``v = v_uncond + s·(v_cond − v_uncond)``, the
unconditional branch using the all-``NULL`` prompt; ``s = 1`` runs the conditional
branch alone. All randomness comes from the optional ``generator``.

The samplers compute where the prompt tokens are (the model's device). The noise is
drawn on the CPU from the (CPU) ``generator`` and moved there: the same seed gives the
same samples on every device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from trainers.diffusion.model import FlowModelConfig
from trainers.diffusion.shapes import NULL
from trainers.weights import to_device


class VelocityModel(Protocol):
    """What the samplers need of a model: FlowDiT, or any wrapper with its interface."""

    config: FlowModelConfig  # the image shape, for the initial noise

    def __call__(self, x: Tensor, t: Tensor, tokens: Tensor) -> Tensor: ...


def timesteps(num_steps: int, shift: float = 1.0, device: torch.device | None = None) -> Tensor:
    """The time grid, (num_steps + 1,) from 1 down to 0, on ``device``.

    ``shift > 1`` spends more steps near the noise end (SD3's ``s·t / (1 + (s − 1)·t)``);
    ``shift = 1`` is uniform.
    """
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"need num_steps >= 1 and shift > 0, got {num_steps}, {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    shifted = shift * t / (1 + (shift - 1) * t)
    shifted[0] = 1.0  # exactly: float32 rounding of s / s can land a step off 1
    return shifted


def sde_sigmas(grid: Tensor, noise_level: float) -> Tensor:
    """σ_t at the start of each step, (num_steps,), for the time grid ``grid``."""
    t = grid[:-1]
    # Only the first step can have t = 1; clamping 1 − t at 1 − t_1 touches no other step.
    return noise_level * torch.sqrt(t / (1 - t).clamp_min(float(1 - grid[1])))


def velocity(
    model: VelocityModel, x: Tensor, t: Tensor, tokens: Tensor, cfg_scale: float = 1.0,
    *, detach_uncond: bool = False,
) -> Tensor:  # fmt: skip
    """The (guided) velocity at (x, t) for prompts ``tokens``; t is a scalar tensor or (N,).

    ``detach_uncond``: the unconditional branch enters as a constant (same values, no
    gradient through it): the loss then moves the guided velocity only through the
    conditional branch."""
    if cfg_scale == 1.0:
        return model(x, t.expand(x.shape[0]), tokens)
    # One forward pass over [conditional; unconditional] rows.
    both = model(
        torch.cat([x, x]),
        t.expand(x.shape[0]).repeat(2),
        torch.cat([tokens, torch.full_like(tokens, NULL)]),
    )
    cond, uncond = both.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + cfg_scale * (cond - uncond)


def transition(
    x: Tensor, v: Tensor, t: Tensor, t_next: Tensor, sigma: Tensor
) -> tuple[Tensor, Tensor]:
    """Mean and std of the SDE step from (x, t) to t_next, given the velocity v."""
    dt = t_next - t
    mean = x + (v + sigma.square() / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, sigma * torch.sqrt(-dt)


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, std²·I), summed over all but the first dimension → (N,)."""
    log_density = (
        -(x - mean).square() / (2 * std.square()) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    )
    return log_density.flatten(1).sum(dim=1)


def cpu_noise(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Gaussian noise on ``device``, drawn on the CPU by design: ``generator`` is a CPU
    one, and its stream (the samples) must not depend on the device."""
    return to_device(torch.randn(shape, generator=generator), device)


def initial_noise(
    model: VelocityModel, tokens: Tensor, generator: torch.Generator | None
) -> Tensor:
    """x at t = 1 for the prompts ``tokens``, on their device."""
    config = model.config
    shape = (tokens.shape[0], config.channels, config.image_size, config.image_size)
    return cpu_noise(shape, generator, tokens.device)


# ----------------------------------------------------------------------------- samplers


@torch.no_grad()
def sample_ode(
    model: VelocityModel,
    tokens: Tensor,
    *,
    num_steps: int,
    shift: float = 1.0,
    cfg_scale: float = 1.0,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Images (N, C, H, W) from the Euler ODE sampler; ``noise`` is x at t = 1."""
    x = initial_noise(model, tokens, generator) if noise is None else noise
    grid = timesteps(num_steps, shift, tokens.device)
    for i in range(num_steps):
        v = velocity(model, x, grid[i], tokens, cfg_scale)
        x = x + v * (grid[i + 1] - grid[i])
    return x


@dataclass(frozen=True)
class Trajectory:
    """One SDE sampling run: everything needed to recompute each transition's density."""

    latents: Tensor  # (N, steps + 1, C, H, W): [:, 0] the initial noise, [:, -1] the image
    log_probs: Tensor  # (N, steps): log-density of each transition when sampled
    tokens: Tensor  # (N, prompt_len)
    timesteps: Tensor  # (steps + 1,), from 1 to 0
    sigmas: Tensor  # (steps,): σ_t of each step
    cfg_scale: float

    @property
    def images(self) -> Tensor:
        return self.latents[:, -1]

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0]

    def __len__(self) -> int:
        return self.latents.shape[0]

    def rows(self, index: Tensor | slice) -> Trajectory:
        """The trajectories of some rows (a mini-batch); the schedule is shared."""
        return replace(
            self, latents=self.latents[index], log_probs=self.log_probs[index],
            tokens=self.tokens[index],
        )  # fmt: skip


@torch.no_grad()
def sample_sde(
    model: VelocityModel,
    tokens: Tensor,
    *,
    num_steps: int,
    noise_level: float,
    shift: float = 1.0,
    cfg_scale: float = 1.0,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Sample with the SDE sampler, recording every latent and transition log-prob."""
    x = initial_noise(model, tokens, generator) if noise is None else noise
    grid = timesteps(num_steps, shift, tokens.device)
    sigmas = sde_sigmas(grid, noise_level)
    latents, log_probs = [x], []
    for i in range(num_steps):
        v = velocity(model, x, grid[i], tokens, cfg_scale)
        mean, std = transition(x, v, grid[i], grid[i + 1], sigmas[i])
        if noise_level > 0:
            x = mean + std * cpu_noise(x.shape, generator, x.device)
            log_probs.append(gaussian_log_prob(x, mean, std))
        else:  # the ODE step itself: mean == x + v·Δt exactly, and there is no density
            x = mean
            log_probs.append(torch.full((x.shape[0],), math.nan, device=x.device))
        latents.append(x)
    return Trajectory(
        latents=torch.stack(latents, dim=1), log_probs=torch.stack(log_probs, dim=1),
        tokens=tokens, timesteps=grid, sigmas=sigmas, cfg_scale=cfg_scale,
    )  # fmt: skip


# ----------------------------------------------------------------------------- training


class StepDensity(NamedTuple):
    """A transition's density under some model: for the ratio, and for a KL penalty
    (two Gaussians of equal std: KL = ‖mean_a − mean_b‖² / (2·std²), summed)."""

    log_prob: Tensor  # (N,), differentiable in the model's parameters
    mean: Tensor  # (N, C, H, W)
    std: Tensor  # scalar


def step_log_prob(
    model: VelocityModel, trajectory: Trajectory, step: int, *, cfg_scale: float | None = None,
    detach_uncond: bool = False,
) -> StepDensity:  # fmt: skip
    """The density of the recorded transition ``step`` (latents[step] → latents[step + 1])
    under ``model``, with gradients (through the conditional branch only, with
    ``detach_uncond``); ``cfg_scale`` defaults to the sampling one.

    Under the sampling weights this reproduces ``trajectory.log_probs[:, step]`` (up to
    float rounding of a different batch size). Call it per step index, on
    ``trajectory.rows(...)`` mini-batches, inside the loss.
    """
    if not 0 <= step < trajectory.num_steps:
        raise IndexError(f"step {step} is outside 0..{trajectory.num_steps - 1}")
    if not bool(trajectory.sigmas[step] > 0):
        raise ValueError("a noise_level = 0 (ODE) transition has no density")
    scale = trajectory.cfg_scale if cfg_scale is None else cfg_scale
    t, t_next = trajectory.timesteps[step], trajectory.timesteps[step + 1]
    x, x_next = trajectory.latents[:, step], trajectory.latents[:, step + 1]
    v = velocity(model, x, t, trajectory.tokens, scale, detach_uncond=detach_uncond)
    mean, std = transition(x, v, t, t_next, trajectory.sigmas[step])
    return StepDensity(gaussian_log_prob(x_next, mean, std), mean, std)


def noised(images: Tensor, t: Tensor, noise: Tensor) -> Tensor:
    """``x_t = (1 − t)·x0 + t·ε`` for per-row times t, (N,)."""
    t = t.view(-1, *([1] * (images.dim() - 1)))
    return (1 - t) * images + t * noise


def flow_matching_loss(
    model: VelocityModel, images: Tensor, tokens: Tensor, t: Tensor, noise: Tensor,
    shared: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """Mean squared error of the predicted velocity against ``ε − x0`` (rectified flow).

    ``shared`` maps the local element count to the one to divide by: under torchrun
    ``corun.shared_count``, so the ranks' mean gradient is the global mean's."""
    prediction = model(noised(images, t, noise), t, tokens)
    return mean_over((prediction - (noise - images)).square(), shared)


def mean_over(values: Tensor, shared: Callable[[Tensor], Tensor] | None) -> Tensor:
    """``values.mean()``, or its sum over ``shared`` of the element count (a mean over
    every rank's elements; at world size 1 the same float as ``mean``)."""
    if shared is None:
        return values.mean()
    count = torch.tensor(float(values.numel()), dtype=values.dtype, device=values.device)
    return values.sum() / shared(count)
