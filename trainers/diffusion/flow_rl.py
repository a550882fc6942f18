"""Flow-GRPO's two halves, for every trainer with an image track (Flow-GRPO itself,
the prompt enhancer, the unified model): sampling scored groups of images with the
SDE sampler, and the clipped loss over a subset of their denoising steps.

Each denoising step of the SDE sampler is a Gaussian policy action with a log-prob;
an image's advantage is its reward against its group (:func:`trainers.pg.group_advantages`,
shared with GRPO) and the loss is the clipped ratio objective
(:func:`trainers.pg.clipped_surrogate`) on each trained step, with an optional KL to
a frozen reference. As in the reference implementation, the ratio uses each
transition's log-density per pixel (the sum over pixels over their number): a
whole-image density ratio moves by orders of magnitude for a tiny weight change, and
clipping would then bite always.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Literal

import msgspec
import torch
from torch import Tensor

from corun import ConfigError, world
from trainers.diffusion.sampling import (
    Trajectory,
    VelocityModel,
    mean_over,
    sample_sde,
    step_log_prob,
)
from trainers.diffusion.shapes import Rewards, score
from trainers.pg import (
    AdvantageScope,
    check_scope_shardable,
    clipped_surrogate,
    group_advantages,
    zero_std_groups,
)
from trainers.weights import to_device

UnitFloat = Annotated[float, msgspec.Meta(gt=0, le=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class FlowGRPOSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How an image track samples, scores and learns."""

    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8
    # SDE noise level a (σ_t = a·sqrt(t / (1 − t))): how far rollouts explore.
    noise_level: Annotated[float, msgspec.Meta(gt=0)] = 0.7
    # Share of the denoising steps trained per rollout: the first ones ("first": the
    # early, noisy steps decide where the shape goes and what colour it is; here they
    # learn 2-3x faster than a random subset) or a random subset per batch.
    timestep_fraction: UnitFloat = 1.0
    timestep_choice: Literal["first", "random"] = "first"
    clip_range: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    adv_clip_max: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    adv_scope: AdvantageScope = "group"
    adv_std_norm: bool = True
    # KL to the frozen starting model (Gaussian steps of equal std: a mean distance).
    kl_coef: NonNegativeFloat = 0.0
    # The reward: color_weight · colour match + (1 − color_weight) · position match.
    color_weight: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


def check_data_parallel(settings: FlowGRPOSettings, table: str = "grpo") -> None:
    """Refuse (one line) the settings a rank cannot apply to its shard alone, under
    torchrun: a batch-wide advantage std, a random subset of steps per rank."""
    if not world().parallel:
        return
    check_scope_shardable(settings.adv_scope, f"{table}.adv_scope")
    if settings.timestep_choice == "random" and settings.timestep_fraction < 1:
        raise ConfigError(
            f'`$.trainer.{table}.timestep_choice` = "random": not under data-parallel '
            'training yet (each rank would train its own steps); use "first" or run.nproc = 1'
        )


@dataclass(frozen=True)
class Sampling:
    """The sampler's schedule: Euler steps on a shifted grid, guidance scale."""

    num_steps: int
    shift: float = 1.0
    cfg_scale: float = 1.0


@dataclass
class ImageGroups:
    """Scored SDE samples, ``samples_per_prompt`` consecutive rows per condition."""

    trajectory: Trajectory  # on the sampler's device
    rewards: Tensor  # (N,), on the CPU
    advantages: Tensor  # (N,), clipped to ±adv_clip_max, on the trajectory's device
    steps: list[int]  # the denoising steps to train on
    # Each image's colour and position rewards too, on the CPU (a prompt enhancer
    # credits each rewrite token with the part of the reward it controls).
    scores: Rewards | None = None

    def __len__(self) -> int:
        return len(self.trajectory)

    def rows(self, rows: slice | Tensor) -> ImageGroups:
        """Some images (a mini-batch); the trained steps are shared."""
        return replace(
            self, trajectory=self.trajectory.rows(rows), rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            scores=None if self.scores is None else Rewards(*(t[rows] for t in self.scores)),
        )  # fmt: skip


# Two more departures, both small: advantages use the unbiased std + 1e-6
# (trainers/pg.py; the reference's tracker uses the population std + 1e-4, so its
# advantages are sqrt(n / (n − 1)) larger, 7 % at n = 8), and the trained step count
# is ceil(steps × timestep_fraction) (the reference truncates), so a fraction never
# trains zero steps.


def sample_groups(
    sampler: VelocityModel, conditions: Tensor, targets: Tensor, settings: FlowGRPOSettings,
    sampling: Sampling, generator: torch.Generator,
) -> tuple[ImageGroups, dict[str, float]]:  # fmt: skip
    """``samples_per_prompt`` images for each row of ``conditions`` (prompt tokens, on
    the sampler's device), scored against ``targets`` (the attributes asked for, on the
    CPU: the same tokens, or the user's intent behind a rewritten prompt); all draws
    from ``generator``. The images are scored on the CPU (by design); the advantages
    go to the device of ``conditions``, where the loss uses them."""
    n = settings.samples_per_prompt
    trajectory = sample_sde(
        sampler, conditions.repeat_interleave(n, dim=0), num_steps=sampling.num_steps,
        noise_level=settings.noise_level, shift=sampling.shift, cfg_scale=sampling.cfg_scale,
        generator=generator,
    )  # fmt: skip
    images = trajectory.images.cpu()  # once per rollout: the rewards are computed on the CPU
    rewards = score(images, targets.repeat_interleave(n, dim=0), settings.color_weight)
    advantages = group_advantages(rewards.total, n, settings.adv_scope, settings.adv_std_norm)
    trained = max(1, math.ceil(sampling.num_steps * settings.timestep_fraction))
    if settings.timestep_choice == "first":
        steps = list(range(trained))
    else:
        steps = sorted(torch.randperm(sampling.num_steps, generator=generator)[:trained].tolist())
    metrics = {
        "reward_mean": float(rewards.total.mean()),
        "reward_std": float(rewards.total.std()),
        "color_reward": float(rewards.color.mean()),
        "position_reward": float(rewards.position.mean()),
        "zero_std_group_ratio": float(zero_std_groups(rewards.total, n).float().mean()),
    }
    clipped = advantages.clamp(-settings.adv_clip_max, settings.adv_clip_max)
    clipped = to_device(clipped, conditions.device)
    return ImageGroups(trajectory, rewards.total, clipped, steps, rewards), metrics


def flow_grpo_step_loss(
    model: VelocityModel, reference: VelocityModel | None, groups: ImageGroups, step: int,
    settings: FlowGRPOSettings, shared: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """The mean clipped loss (+ KL) of the groups' transitions at denoising ``step``, and
    its ``clip_ratio``, ``kl`` and ``approx_kl``. A trainer backpropagates one step at a
    time (micro-batches), so memory holds one step's graph. ``shared`` (under torchrun
    ``corun.shared_count``) maps the local image count to the one the means divide by.

    Where this departs from the reference implementation, and why:

    - ``kl`` is the exact KL between the two Gaussian transitions, ‖Δmean‖² / (2·std²)
      per pixel with std = σ_t·sqrt(|Δt|). The reference divides by σ_t² alone (no
      |Δt|), so its KL is this one × |Δt|: at 10 uniform steps ``kl_coef = 0.05`` here
      acts like 0.5 there. Kept: it is the divergence the name promises, and it does
      not change meaning with the number of steps.
    - With guidance the unconditional branch is a constant in the loss (detached), a
      choice of corun's (some Flow-GRPO derivatives make it; the official train_sd3.py
      keeps its gradient): the unconditional model is trained by no reward, and its
      coefficient (1 − s) is negative for s > 1, so its gradient pushes it the wrong
      way.
    - ``approx_kl`` and ``clip_ratio`` are the reference's logged metrics:
      ½·mean((log π − log π_old)²) and the share of |ratio − 1| > clip_range.
    """
    trajectory, advantages = groups.trajectory, groups.advantages
    pixels = trajectory.latents[0, 0].numel()
    density = step_log_prob(model, trajectory, step, detach_uncond=True)
    logp, old_logp = density.log_prob / pixels, trajectory.log_probs[:, step] / pixels
    per_image, _ = clipped_surrogate(
        logp, old_logp, advantages, settings.clip_range, settings.clip_range
    )
    loss = mean_over(per_image, shared)
    kl = torch.zeros((), device=logp.device)
    if reference is not None:
        with torch.no_grad():
            anchor = step_log_prob(reference, trajectory, step).mean
        # Two Gaussians of equal std: KL = |mean − anchor|² / (2·std²), per pixel.
        distance = (density.mean - anchor).square().flatten(1).mean(dim=1)
        kl = mean_over(distance / (2 * density.std.square()), shared)
        loss = loss + settings.kl_coef * kl
    log_ratio = logp.detach() - old_logp
    clipped = (torch.expm1(log_ratio).abs() > settings.clip_range).to(log_ratio.dtype)
    return loss, {
        "clip_ratio": float(mean_over(clipped, shared)),
        "kl": float(kl.detach()),
        "approx_kl": float(mean_over(0.5 * log_ratio.square(), shared)),
    }
