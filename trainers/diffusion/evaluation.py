"""Held-out evaluation of a flow model, shared by the flow trainers: ODE samples of
fixed held-out prompts from fixed noise, their rewards, a PNG grid, and the
flow-matching loss on a fixed batch.

Every input is built once from its own generator, so an evaluation draws nothing
from the global RNGs and gives the same numbers for the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

import corun
from trainers.diffusion.grid import save_grid
from trainers.diffusion.sampling import VelocityModel, flow_matching_loss, sample_ode
from trainers.diffusion.shapes import IMAGE_SIZE, captions, eval_tokens, render, score
from trainers.weights import to_device


class HeldOutEval:
    """``size`` held-out prompts (cycling through all 18) with fixed noise; PNG grids of
    the first ``grid_size`` samples go to ``samples_dir/step-<N>.png``. The model's
    inputs are on ``device`` (the model's); rewards and grids are computed on the CPU."""

    def __init__(
        self, size: int, jitter: float, samples_dir: Path, grid_size: int,
        device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.prompts = eval_tokens(size)  # on the CPU: what the rewards and captions read
        self.samples_dir = samples_dir
        self.grid_size = grid_size
        # Drawn on the CPU by design (one CPU generator: the same inputs on every
        # device), then moved to ``device`` once.
        generator = corun.generator("flow-eval")
        shape = (size, 3, IMAGE_SIZE, IMAGE_SIZE)
        noise = torch.randn(shape, generator=generator)
        # The loss batch: images as the training data renders them, its own times and noise.
        images = render(self.prompts, generator, jitter)
        loss_t = torch.rand(size, generator=generator)
        loss_noise = torch.randn(shape, generator=generator)
        self.tokens, self.noise, self.images, self.loss_t, self.loss_noise = (
            to_device(t, device) for t in (self.prompts, noise, images, loss_t, loss_noise)
        )

    def grid_path(self, step: int) -> Path:
        return self.samples_dir / f"step-{step}.png"

    @torch.no_grad()
    def loss(self, model: VelocityModel) -> float:
        return float(
            flow_matching_loss(model, self.images, self.tokens, self.loss_t, self.loss_noise)
        )

    @torch.no_grad()
    def samples(
        self, model: VelocityModel, *, num_steps: int, shift: float, cfg_scale: float,
        step: int | None = None, conditions: Tensor | None = None,
        labels: Sequence[str] | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Mean rewards of ODE samples; with ``step``, also writes that step's grid.

        ``conditions`` (default: the held-out prompts) are what the model is given,
        e.g. a prompt enhancer's rewrites; the rewards always score the held-out
        prompts. ``labels`` replace the grid's captions (default: the prompts)."""
        conditions = self.tokens if conditions is None else conditions
        # To the CPU once: the rewards and the grid are computed there by design.
        images = sample_ode(
            model, conditions, num_steps=num_steps, shift=shift, cfg_scale=cfg_scale,
            noise=self.noise,
        ).cpu()  # fmt: skip
        rewards = score(images, self.prompts)
        if step is not None and self.grid_size:
            n = self.grid_size
            names = captions(self.prompts[:n]) if labels is None else list(labels[:n])
            save_grid(images[:n], names, self.grid_path(step))
        return {
            "eval/reward": float(rewards.total.mean()),
            "eval/color_reward": float(rewards.color.mean()),
            "eval/position_reward": float(rewards.position.mean()),
        }
