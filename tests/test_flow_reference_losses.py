"""trainers/diffusion/flow_rl.py against references from the published semantics of the
official Flow-GRPO training loop (yifan123/flow_grpo, scripts/train_sd3.py):
flow_grpo_step_loss (per-pixel log-prob ratio, clipped surrogate, KL to a frozen
reference, the logged clip_ratio and approx_kl) and its gradient, and sample_groups'
advantages clipped at adv_clip_max.

As in test_flow_reference.py: float64 references that never call the code under test,
seeded random cases per dtype, the old log-probs taken as recorded (the reference
reads ``sample["log_probs"]`` too). The schedule is float32 whatever the latents, so
both dtypes are held to the float32 tolerance (see test_flow_reference.py).

Documented choices, tested as documented:

- ``kl`` is the exact KL of the two Gaussian steps, ‖Δmean‖²/(2·std²) per pixel with
  std = σ_t·sqrt(|Δt|): the reference's ``((Δmean)²).mean / (2·σ_t²)`` divided by |Δt|.
- With guidance the unconditional branch is detached in the loss: same values, the
  gradient flows through the prompt branch only.
"""

from __future__ import annotations

import math
import random
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.test_flow_reference import (
    DTYPES,
    F32,
    F64,
    TOL,
    WORST,
    Toy,
    close,
    random_schedule,
    ref_log_density,
    ref_sigma,
    ref_step,
    ref_velocity,
)
from tests.test_pg_reference import grpo_slack, ref_grpo
from trainers.diffusion import shapes
from trainers.diffusion.flow_rl import (
    FlowGRPOSettings,
    ImageGroups,
    Sampling,
    flow_grpo_step_loss,
    sample_groups,
)
from trainers.diffusion.sampling import Trajectory, sample_sde

NUM_CASES = 300


def perturbed(model: Toy, size: float, generator: torch.Generator) -> Toy:
    """A copy of ``model`` with every weight moved by size·N(0, 1)."""
    copy = Toy(model.config.channels, model.config.image_size, model.mix.dtype, generator)
    with torch.no_grad():
        for mine, theirs in zip(copy.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs + size * torch.randn(theirs.shape, generator=generator,
                                                   dtype=theirs.dtype))  # fmt: skip
    return copy


class RefLoss:
    """The reference's per-timestep loss on one recorded step, float64, differentiable in
    the policy's weights (the unconditional branch under no_grad unless ``grad_uncond``,
    the anchor always)."""

    def __init__(self, model: nn.Module, anchor_model: nn.Module | None, traj: Trajectory,
                 advantages: Tensor, step: int, noise_level: float,
                 grad_uncond: bool = False) -> None:  # fmt: skip
        grid = traj.timesteps.tolist()
        t, t_next, sigma = grid[step], grid[step + 1], ref_sigma(grid, step, noise_level)
        x, y = traj.latents[:, step], traj.latents[:, step + 1]
        v = ref_velocity(model, x, t, traj.tokens, traj.cfg_scale, grad_uncond=grad_uncond)
        mean, std = ref_step(x, v, t, t_next, sigma)
        terms = ref_log_density(y, mean, std).flatten(1)
        self.logp = terms.mean(dim=1)  # log_prob.mean(dim=all but batch)
        self.old = traj.log_probs[:, step].to(F64) / terms.shape[1]
        self.log_ratio = (self.logp - self.old).detach()
        self.advantages = advantages.to(F64)
        # Rounding scales: of a per-pixel log-prob (its terms' size, and the mean's
        # rounding, eps·(|x| + |v|)/std, through the quadratic term), and of the mean.
        z = ((y.to(F64) - mean) / std).detach()
        spread = (z.abs() * (x.abs() + v.detach().abs()).to(F64) / std).flatten(1)
        self.logp_scale = terms.detach().abs().mean(dim=1) + spread.mean(dim=1) + 1
        step_size, drift = t - t_next, sigma**2 / (2 * t)
        self.mean_scale = (x.abs() * (1 + drift * step_size)).to(F64) + (
            v.detach().abs() * step_size * (1 + drift)
        ).to(F64)
        self.kl = self.kl_scale = torch.zeros((), dtype=F64)
        self.kl_conditioning = 0.0  # rounding of Δmean relative to Δmean, per eps
        if anchor_model is not None:
            with torch.no_grad():
                v_ref = ref_velocity(anchor_model, x, t, traj.tokens, traj.cfg_scale)
            anchor, _ = ref_step(x, v_ref, t, t_next, sigma)
            flow_grpo_kl = ((mean - anchor) ** 2).flatten(1).mean(dim=1) / (2 * sigma**2)
            self.kl = flow_grpo_kl.mean() / (t - t_next)  # documented: the exact KL
            gap = (mean - anchor).detach().abs()
            self.kl_scale = (
                (gap * self.mean_scale).flatten(1).mean(dim=1).mean() / sigma**2 / (t - t_next)
            )
            if gap.max() > 0:
                self.kl_conditioning = float(self.mean_scale.max() / gap.max())

    def loss(self, clip: float, kl_coef: float) -> Tensor:
        ratio = torch.exp(self.logp - self.old)
        unclipped = -self.advantages * ratio
        clipped = -self.advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
        return torch.mean(torch.maximum(unclipped, clipped)) + kl_coef * self.kl

    def loss_scale(self, kl_coef: float) -> Tensor:
        ratio = self.log_ratio.exp()
        return (self.advantages.abs() * ratio * self.logp_scale).mean() + kl_coef * self.kl_scale

    def ratio_scale(self) -> Tensor:
        """Per row, what the rounding of its log-ratio (and so of ratio − 1) scales with."""
        return self.logp_scale * (1 + self.log_ratio.exp())

    def margins(self) -> Tensor:
        """How far a row's |ratio − 1| is known."""
        return TOL[F32] * self.ratio_scale()

    def pick_clip(self, rng: random.Random) -> float:
        """A clip_range that no row's |ratio − 1| ties with: below all, above all, or in a
        gap between two of them, chosen at random among those every row is clear of."""
        d = sorted(torch.expm1(self.log_ratio).abs().tolist())
        candidates = [d[0] / 2, 2 * d[-1] + 1e-4, *((a + b) / 2 for a, b in pairwise(d))]
        clear = [c for c in candidates if c > 0 and self.undecided(c) == 0]
        return rng.choice(clear) if clear else d[-1] + 0.1

    def undecided(self, clip: float) -> int:
        distance = (torch.expm1(self.log_ratio).abs() - clip).abs()
        return int((distance <= self.margins()).sum())


def loss_case(seed: int, dtype: torch.dtype) -> tuple[random.Random, Toy, Toy | None, ImageGroups,
                                                     int, float]:  # fmt: skip
    """A policy near the sampling one (exactly it, or up to 0.1·N(0, 1) away), an
    optional frozen reference, advantages (some 0), a recorded step (often first/last)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_steps, shift, noise_level, cfg = random_schedule(rng)
    n, channels, size = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 6)
    old = Toy(channels, size, dtype, g)
    model = perturbed(old, rng.choice([0.0, 1e-4, 1e-3, 1e-2, 0.1]), g)
    anchor = rng.choice([None, old, perturbed(old, 0.05, g)])
    tokens = torch.randint(1, shapes.VOCAB_SIZE, (n, 3), generator=g)
    noise = torch.randn(n, channels, size, size, generator=g, dtype=dtype)
    traj = sample_sde(old, tokens, num_steps=num_steps, noise_level=noise_level, shift=shift,
                      cfg_scale=cfg, noise=noise, generator=g)  # fmt: skip
    values = [rng.choice([0.0, rng.uniform(-5, 5)]) for _ in range(n)]
    advantages = torch.tensor(values, dtype=dtype)
    groups = ImageGroups(traj, torch.zeros(n, dtype=dtype), advantages, list(range(num_steps)))
    step = rng.choice([0, num_steps - 1, rng.randrange(num_steps)])
    return rng, model, anchor, groups, step, noise_level


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_loss_and_metrics_match_reference(dtype: torch.dtype) -> None:
    """loss, clip_ratio (clipfrac), approx_kl and kl against the reference's, with
    clip_range between the rows' |ratio − 1| so that both sides are hit."""
    num_clipped = num_partly = 0
    for seed in range(NUM_CASES):
        rng, model, anchor, groups, step, noise_level = loss_case(seed, dtype)
        ref = RefLoss(model, anchor, groups.trajectory, groups.advantages, step, noise_level)
        clip, kl_coef = ref.pick_clip(rng), rng.choice([0.0, 0.05, rng.uniform(0, 2)])
        settings = FlowGRPOSettings(noise_level=noise_level, clip_range=clip, kl_coef=kl_coef)
        loss, metrics = flow_grpo_step_loss(model, anchor, groups, step, settings)
        with torch.no_grad():
            want = ref.loss(clip, kl_coef)
        close("flow_grpo_step_loss loss", loss, want, dtype, seed, ref.loss_scale(kl_coef),
              tol=TOL[F32])  # fmt: skip
        lr = ref.log_ratio
        clipfrac = float(((lr.exp() - 1.0).abs() > clip).double().mean())
        # A share of at most 6 rows: float32 rounding, never a row's worth.
        assert metrics["clip_ratio"] == pytest.approx(clipfrac, abs=1e-6), (seed, metrics)
        num_clipped += clipfrac > 0
        num_partly += 0 < clipfrac < 1
        approx_kl = 0.5 * torch.mean(lr**2)
        close("flow_grpo_step_loss approx_kl", torch.tensor(metrics["approx_kl"], dtype=dtype),
              approx_kl, dtype, seed, (lr.abs() * ref.ratio_scale()).mean(),
              tol=TOL[F32])  # fmt: skip
        close("flow_grpo_step_loss kl", torch.tensor(metrics["kl"], dtype=dtype), ref.kl, dtype,
              seed, ref.kl_scale, tol=TOL[F32])  # fmt: skip
    assert num_clipped > NUM_CASES // 4 and num_partly > NUM_CASES // 10, (num_clipped, num_partly)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_is_the_reference_kl_over_dt(dtype: torch.dtype) -> None:
    """The documented relation on one case per grid step: kl·|Δt| is the reference's
    ((Δmean)²).mean / (2·σ_t²), which does not change meaning with the step size."""
    g = torch.Generator().manual_seed(0)
    old = Toy(2, 3, dtype, g)
    anchor = perturbed(old, 0.05, g)
    traj = sample_sde(old, torch.randint(1, 9, (4, 3), generator=g), num_steps=5, noise_level=0.9,
                      shift=3.0, noise=torch.randn(4, 2, 3, 3, generator=g, dtype=dtype),
                      generator=g)  # fmt: skip
    groups = ImageGroups(traj, torch.zeros(4), torch.ones(4, dtype=dtype), list(range(5)))
    for step in range(5):
        _, metrics = flow_grpo_step_loss(old, anchor, groups, step, FlowGRPOSettings(kl_coef=1.0))
        ref = RefLoss(old, anchor, traj, groups.advantages, step, 0.9)
        dt = float(traj.timesteps[step] - traj.timesteps[step + 1])
        flow_grpo_value = float(ref.kl.detach()) * dt
        assert metrics["kl"] * dt == pytest.approx(flow_grpo_value, rel=1e-5), step
        assert metrics["kl"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_loss_gradient_matches_reference(dtype: torch.dtype) -> None:
    """∂loss/∂weights against the reference loss's autograd (float64 math), where v(∅)
    and the anchor are computed under no_grad. At s ≠ 1 a v(∅) with gradient would
    give another gradient: the difference must show in some cases."""
    num_detach_matters = 0
    for seed in range(NUM_CASES // 3):
        rng, model, anchor, groups, step, noise_level = loss_case(seed, dtype)
        ref = RefLoss(model, anchor, groups.trajectory, groups.advantages, step, noise_level)
        clip, kl_coef = ref.pick_clip(rng), rng.choice([0.0, 0.5])
        settings = FlowGRPOSettings(noise_level=noise_level, clip_range=clip, kl_coef=kl_coef)
        if ref.undecided(clip):  # a tie at the clip: the gradient is discontinuous there
            continue
        params = list(model.parameters())
        loss, _ = flow_grpo_step_loss(model, anchor, groups, step, settings)
        got = torch.cat([p.flatten() for p in torch.autograd.grad(loss, params)])
        want_loss = ref.loss(clip, kl_coef)
        want = torch.cat([p.flatten() for p in torch.autograd.grad(want_loss, params)])
        # The KL's gradient is Δmean·∂mean/σ²: in float32 a policy near its anchor has a
        # Δmean whose rounding (eps·|mean|) is large relative to Δmean itself.
        conditioning = ref.kl_conditioning if kl_coef and dtype == F32 else 0.0
        relative = 1 + float(ref.ratio_scale().max()) + conditioning
        scale = float(want.abs().max()) * relative + float(ref.loss_scale(kl_coef))
        close("flow_grpo_step_loss grad", got, want.to(F64), dtype, seed, scale, tol=TOL[F32])
        attached = RefLoss(model, anchor, groups.trajectory, groups.advantages, step,
                           noise_level, grad_uncond=True).loss(clip, kl_coef)  # fmt: skip
        other = torch.cat([p.flatten() for p in torch.autograd.grad(attached, params)])
        num_detach_matters += bool((other - want).abs().max() > 1e-3 * scale)
    assert num_detach_matters > 5


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("timestep_choice", ["first", "random"])
def test_sample_groups_advantages_are_clipped_reference(timestep_choice: Any) -> None:
    """advantages = clamp(GRPO advantage of the group, ±adv_clip_max); groups are
    consecutive rows of one prompt. The GRPO advantage is corun's (pg.group_advantages:
    unbiased std + 1e-6; test_pg_reference.ref_grpo); Flow-GRPO's stat tracker divides
    by the population std + 1e-4 (a sqrt(n / (n − 1)) larger advantage)."""
    num_bit = 0
    for seed in range(60):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        num_steps, shift, noise_level, cfg = random_schedule(rng)
        n, num_prompts = rng.randint(2, 6), rng.randint(1, 4)
        scope: Any = rng.choice(["group", "batch"])
        std_norm = rng.random() < 0.8
        clip_max = rng.choice([0.3, 0.8, 5.0, rng.uniform(0.1, 3.0)])
        settings = FlowGRPOSettings(
            samples_per_prompt=n, noise_level=noise_level, adv_clip_max=clip_max, adv_scope=scope,
            adv_std_norm=std_norm, timestep_fraction=rng.uniform(0.1, 1.0),
            timestep_choice=timestep_choice,
        )  # fmt: skip
        conditions = shapes.sample_prompts(shapes.TRAIN_PROMPTS, num_prompts, g)
        model = Toy(3, shapes.IMAGE_SIZE, F32, g)
        groups, _ = sample_groups(model, conditions, conditions, settings,
                                  Sampling(num_steps, shift, cfg), g)  # fmt: skip
        assert torch.equal(groups.trajectory.tokens, conditions.repeat_interleave(n, dim=0))
        rewards = groups.rewards.tolist()
        unclipped = ref_grpo(rewards, n, scope, std_norm)
        expected = [min(max(a, -clip_max), clip_max) for a in unclipped]
        slack = grpo_slack(rewards, n, scope, std_norm)
        close("sample_groups advantages", groups.advantages, expected, F32, seed,
              scale=slack / TOL[F32] + 1)  # fmt: skip
        num_bit += sum(abs(a) > clip_max for a in unclipped)
        # corun rounds the trained share up (at least one step); the reference floors it.
        assert len(groups.steps) == max(1, math.ceil(num_steps * settings.timestep_fraction))
    assert num_bit > 10, num_bit


if __name__ == "__main__":
    torch.set_num_threads(1)  # as tests/conftest.py
    for dtype in (F32, F64):
        test_step_loss_and_metrics_match_reference(dtype)
        test_kl_is_the_reference_kl_over_dt(dtype)
        test_step_loss_gradient_matches_reference(dtype)
    for choice in ("first", "random"):
        test_sample_groups_advantages_are_clipped_reference(choice)
    for key, worst in sorted(WORST.items()):
        print(f"{key:48s} {worst:.1e}")
