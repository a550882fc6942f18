"""trainers/diffusion/sampling.py and flow_rl.py against references written
independently from the published semantics of the official Flow-GRPO
(yifan123/flow_grpo).

The sampler (``sde_step_with_logprob`` in flow_grpo/diffusers_patch/
sd3_sde_with_logprob.py): the shifted time grid, σ_t, the SDE transition's mean and
std, its Gaussian log-density, the sampler's recorded log-probs and their
recomputation, and the gradient of the guided velocity with the unconditional branch
detached.

The loss (scripts/train_sd3.py): flow_grpo_step_loss (per-pixel log-prob ratio, clipped
surrogate, KL to a frozen reference, the logged clip_ratio and approx_kl) and its
gradient, and sample_groups' advantages clipped at adv_clip_max. The old log-probs are
taken as recorded (the reference reads ``sample["log_probs"]`` too). The schedule is
float32 whatever the latents, so the loss tests hold both dtypes to the float32
tolerance.

Each reference is float64 and written in the shape of the published formula (the
mean as ``x·(1 + σ²/(2t)·Δt) + v·(1 + σ²(1 − t)/(2t))·Δt``, not corun's grouping;
log-densities summed exactly with math.fsum) and never calls the functions under
test. Models are called, not tested: the reference velocity runs the conditional and
unconditional branches as two separate calls. Seeded random cases per dtype: shapes,
grids with shift, noise levels, guidance scales including 1, and the first (t = 1
clamp) and last steps; float32 inputs are compared on their rounded values.

Convention (corun's): ``x_t = (1 − t)·x0 + t·ε``, ``v = ε − x0``, t from 1 to 0, Δt < 0.

Documented choices, tested as documented:

- ``kl`` is the exact KL of the two Gaussian steps, ‖Δmean‖²/(2·std²) per pixel with
  std = σ_t·sqrt(|Δt|): the reference's ``((Δmean)²).mean / (2·σ_t²)`` divided by |Δt|.
- With guidance the unconditional branch is detached in the loss: same values, the
  gradient flows through the prompt branch only.

``python -m tests.test_flow_reference`` prints the worst difference seen per function.
"""

from __future__ import annotations

import math
import random
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.test_pg_reference import grpo_slack, ref_grpo
from trainers.diffusion import shapes
from trainers.diffusion.flow_rl import (
    FlowGRPOSettings,
    ImageGroups,
    Sampling,
    flow_grpo_step_loss,
    sample_groups,
)
from trainers.diffusion.model import FlowDiT, FlowModelConfig
from trainers.diffusion.sampling import (
    Trajectory,
    gaussian_log_prob,
    sample_sde,
    sde_sigmas,
    step_log_prob,
    timesteps,
    transition,
    velocity,
)
from trainers.diffusion.shapes import NULL, VOCAB_SIZE

F32, F64 = torch.float32, torch.float64
DTYPES = [pytest.param(F32, id="float32"), pytest.param(F64, id="float64")]
NUM_CASES = 300
# Relative tolerance per dtype, against |reference| + the inputs' rounding scale.
TOL = {F32: 2e-5, F64: 1e-10}
# Worst |code − reference| / (|reference| + scale) per (function, dtype), for the report.
WORST: dict[str, float] = {}


def close(name: str, actual: Tensor, expected: Tensor | list[float] | float, dtype: torch.dtype,
          seed: int, scale: Tensor | float = 1.0, tol: float | None = None) -> None:  # fmt: skip
    """``actual`` (code under test) matches ``expected`` (float64 reference) within
    ``tol`` (TOL[dtype]) of |expected| + ``scale``, the size of what rounding touched."""
    assert actual.dtype == dtype, (name, actual.dtype)
    got, want = actual.detach().to(F64), torch.as_tensor(expected, dtype=F64).detach()
    error = (got - want).abs()
    allowed = want.abs() + (scale.detach() if isinstance(scale, Tensor) else scale)
    key = f"{name} {str(dtype).removeprefix('torch.')}"
    relative = torch.where(error == 0, 0.0, error / allowed)  # 0/0 where both are exactly 0
    WORST[key] = max(WORST.get(key, 0.0), float(relative.max()))
    bad = ~(error <= (TOL[dtype] if tol is None else tol) * allowed)  # NaN counts as bad
    assert not bad.any(), f"{name}, seed {seed}: got {got[bad]}, want {want[bad]}"


# ----------------------------------------------------------------------------- references


def ref_timesteps(num_steps: int, shift: float) -> list[float]:
    """SD3's shifted schedule: s·u / (1 + (s − 1)·u) for u = 1, 1 − 1/n, ..., 0."""
    fractions = [1 - i / num_steps for i in range(num_steps + 1)]
    return [shift * u / (1 + (shift - 1) * u) for u in fractions]


def ref_sigma(grid: list[float], i: int, noise_level: float) -> float:
    """std_dev_t = a·sqrt(t / (1 − t)), where the first step (t = 1) uses 1 − t_1
    (the reference's ``sigma_max = sigmas[1]``)."""
    t = grid[i]
    return noise_level * math.sqrt(t / (1 - (grid[1] if i == 0 else t)))


def ref_step(x: Tensor, v: Tensor, t: float, t_next: float, sigma: float) -> tuple[Tensor, float]:
    """prev_sample_mean and its std: x·(1 + σ²/(2t)·dt) + v·(1 + σ²(1 − t)/(2t))·dt,
    std = σ·sqrt(−dt)."""
    dt = t_next - t
    mean = (
        x.to(F64) * (1 + sigma**2 / (2 * t) * dt)
        + v.to(F64) * (1 + sigma**2 * (1 - t) / (2 * t)) * dt
    )
    return mean, sigma * math.sqrt(-dt)


def ref_log_density(y: Tensor, mean: Tensor, std: float) -> Tensor:
    """−(y − mean)²/(2·std²) − log std − log sqrt(2π), per element (float64)."""
    constant = math.log(std) + math.log(math.sqrt(2 * math.pi))
    return -((y.to(F64) - mean) ** 2) / (2 * std**2) - constant


def row_sums(terms: Tensor) -> tuple[list[float], list[float]]:
    """Exact per-row sums of (N, ...) terms, and of their magnitudes (what rounding scales with)."""
    rows = terms.flatten(1).tolist()
    return [math.fsum(r) for r in rows], [math.fsum(map(abs, r)) for r in rows]


def ref_velocity(model: nn.Module, x: Tensor, t: float, tokens: Tensor, scale: float,
                 *, grad_uncond: bool = True) -> Tensor:  # fmt: skip
    """(1 − s)·v(∅) + s·v(prompt), two separate calls; s = 1 is the prompt alone.
    ``grad_uncond=False`` runs the unconditional call under no_grad."""
    ts = torch.full((len(x),), t)
    cond = model(x, ts, tokens)
    if scale == 1.0:
        return cond
    with torch.set_grad_enabled(grad_uncond and torch.is_grad_enabled()):
        uncond = model(x, ts, torch.full_like(tokens, NULL))
    return (1 - scale) * uncond + scale * cond


class Toy(nn.Module):
    """A stand-in velocity model with FlowDiT's call interface, for any image shape and
    dtype: per pixel, non-linear in x, t and the prompt (so v(∅) ≠ v(prompt)), and rows
    independent of each other, so batch composition cannot change a row's value."""

    config: FlowModelConfig

    def __init__(self, channels: int, size: int, dtype: torch.dtype, generator: torch.Generator):
        super().__init__()
        self.config = FlowModelConfig(
            image_size=size, channels=channels, patch_size=1, d_model=2, n_heads=1
        )

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype) * 0.7)

        self.mix, self.time = param(channels, channels), param(channels)
        self.emb, self.pos = param(VOCAB_SIZE, channels), param(channels, size, size)

    def forward(self, x: Tensor, t: Tensor, tokens: Tensor) -> Tensor:
        n = len(x)
        h = torch.einsum("dc,nchw->ndhw", self.mix, x) + self.pos
        h = h + self.time.view(1, -1, 1, 1) * t.to(x.dtype).view(n, 1, 1, 1)
        h = h + self.emb[tokens].sum(dim=1).view(n, -1, 1, 1)
        return 1.5 * torch.tanh(h) - 0.4 * x


def tiny_dit(seed: int) -> FlowDiT:
    """A tiny FlowDiT with its zero-initialised layers randomised, so v ≠ 0."""
    torch.manual_seed(seed)
    model = FlowDiT(FlowModelConfig(d_model=32, n_layers=1, n_heads=2))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2 and not param.any():
                nn.init.normal_(param, std=0.1)
    return model.eval()


def random_schedule(rng: random.Random) -> tuple[int, float, float, float]:
    """num_steps, shift, noise_level, cfg_scale."""
    return (
        rng.choice([1, 2, rng.randint(1, 8)]), rng.choice([1.0, 3.0, rng.uniform(0.3, 6.0)]),
        rng.choice([0.7, rng.uniform(0.05, 2.0)]), rng.choice([1.0, 1.0, 4.5, rng.uniform(0, 7)]),
    )  # fmt: skip


# ----------------------------------------------------------------------------- schedule


def test_timesteps_match_reference() -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        n, shift = rng.randint(1, 60), rng.choice([1.0, 3.0, rng.uniform(0.1, 8.0)])
        grid = timesteps(n, shift)
        close("timesteps", grid, ref_timesteps(n, shift), F32, seed, scale=0.0)
        assert grid[-1] == 0 and bool((grid.diff() < 0).all()), (seed, grid)


def test_timesteps_start_exactly_at_one() -> None:
    """The docstring's "from 1": float32 rounding of s·1/(1 + (s − 1)·1) used to give
    1 ± 1 ulp for 274 of 2000 random (num_steps, shift) (shift 2.8949515, 21 steps:
    1.0000001); the first time is now set exactly."""
    rng = random.Random(0)
    starts = [float(timesteps(rng.randint(1, 60), rng.uniform(0.1, 8.0))[0]) for _ in range(500)]
    assert starts == [1.0] * 500


@pytest.mark.parametrize("dtype", DTYPES)
def test_sde_sigmas_match_reference(dtype: torch.dtype) -> None:
    """On shifted grids and on arbitrary decreasing grids from 1 to 0."""
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        n, noise_level = rng.randint(1, 40), rng.choice([0.7, rng.uniform(0.01, 3.0)])
        if rng.random() < 0.5:
            values = ref_timesteps(n, rng.choice([1.0, 3.0, rng.uniform(0.1, 8.0)]))
        else:
            values = [1.0, *sorted((rng.random() for _ in range(n - 1)), reverse=True), 0.0]
        grid = torch.tensor(values, dtype=dtype)
        rounded = grid.tolist()
        expected = [ref_sigma(rounded, i, noise_level) for i in range(n)]
        close("sde_sigmas", sde_sigmas(grid, noise_level), expected, dtype, seed, scale=0.0)
        assert not sde_sigmas(grid, 0.0).any()


# ----------------------------------------------------------------------------- one transition


def random_step(rng: random.Random, g: torch.Generator, dtype: torch.dtype,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """x, v (random shapes and sizes) and 0-dim t, t_next, σ of a random grid step,
    the first and the last steps often."""
    _, shift, noise_level, _ = random_schedule(rng)
    n = rng.randint(1, 30)
    grid = ref_timesteps(n, shift)
    i = rng.choice([0, n - 1, rng.randrange(n)])
    shape = (rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 6))
    x = torch.randn(shape, generator=g, dtype=dtype) * rng.choice([1.0, 3.0])
    v = torch.randn(shape, generator=g, dtype=dtype) * rng.choice([0.5, 1.0, 3.0])
    scalars = (grid[i], grid[i + 1], ref_sigma(grid, i, noise_level))
    t, t_next, sigma = (torch.tensor(s, dtype=dtype) for s in scalars)
    return x, v, t, t_next, sigma


@pytest.mark.parametrize("dtype", DTYPES)
def test_transition_matches_reference(dtype: torch.dtype) -> None:
    for seed in range(NUM_CASES):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        x, v, t, t_next, sigma = random_step(rng, g, dtype)
        mean, std = transition(x, v, t, t_next, sigma)
        want_mean, want_std = ref_step(x, v, float(t), float(t_next), float(sigma))
        dt, drift = float(t - t_next), float(sigma) ** 2 / (2 * float(t))
        scale = x.abs() * (1 + drift * dt) + v.abs() * dt * (1 + drift)
        close("transition mean", mean, want_mean, dtype, seed, scale.to(F64))
        close("transition std", std, want_std, dtype, seed, scale=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_log_prob_matches_reference(dtype: torch.dtype) -> None:
    """Points near the mean (as sampled) and far from it; stds from 1e-4 to 10."""
    for seed in range(NUM_CASES):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        shape = (rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 8))
        std = torch.tensor(10 ** rng.uniform(-4, 1), dtype=dtype)
        mean = torch.randn(shape, generator=g, dtype=dtype) * rng.choice([0.1, 1.0, 5.0])
        z = torch.randn(shape, generator=g, dtype=dtype) * rng.choice([1.0, 1.0, 5.0, 100.0])
        y = mean + float(std) * z
        expected, magnitude = row_sums(ref_log_density(y, mean.to(F64), float(std)))
        scale = torch.tensor(magnitude, dtype=F64)
        close("gaussian_log_prob", gaussian_log_prob(y, mean, std), expected, dtype, seed, scale)


# ----------------------------------------------------------------------------- the sampler


def reference_log_probs(
    model: nn.Module, traj: Trajectory, step: int, rows: Tensor, noise_level: float, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``rows``: the log-density of latents[step] → latents[step + 1] from the
    reference formulas (grid values as recorded), its rounding scale, and the z-scores."""
    grid = traj.timesteps.tolist()
    x, y = (traj.latents[rows, step + k] for k in (0, 1))
    with torch.no_grad():
        v = ref_velocity(model, x, grid[step], traj.tokens[rows], scale)
    mean, std = ref_step(x, v, grid[step], grid[step + 1], ref_sigma(grid, step, noise_level))
    expected, magnitude = row_sums(ref_log_density(y, mean, std))
    z = (y.to(F64) - mean) / std
    # Rounding in the mean moves z by ~eps·(|x| + |v|)/std: the quadratic term by |z|× that.
    spread = z.abs() * (x.abs() + v.abs()).to(F64) / std
    scale_ = torch.tensor(magnitude, dtype=F64) + spread.flatten(1).sum(dim=1)
    return torch.tensor(expected, dtype=F64), scale_, z


def sampler_cases(kind: str, num_cases: int) -> list[tuple[int, torch.dtype, Toy | FlowDiT]]:
    """(seed, dtype, model): tiny FlowDiTs (float32 only), or Toys of random image shapes."""
    if kind == "flowdit":
        return [(seed, F32, tiny_dit(seed)) for seed in range(num_cases)]
    dtype = F32 if kind == "toy-float32" else F64
    out: list[tuple[int, torch.dtype, Toy | FlowDiT]] = []
    for seed in range(num_cases):
        rng = random.Random(seed)
        size, channels = rng.randint(1, 6), rng.randint(1, 3)
        out.append((seed, dtype, Toy(channels, size, dtype, torch.Generator().manual_seed(seed))))
    return out


@pytest.mark.parametrize(("kind", "num_cases"),
                         [("toy-float32", 120), ("toy-float64", 120), ("flowdit", 6)])  # fmt: skip
def test_sampler_log_probs_match_reference(kind: str, num_cases: int) -> None:
    """sample_sde's recorded log-probs, and step_log_prob's recomputation on a random row
    subset (at the sampling scale or another), equal the reference density of each
    recorded transition; the recorded steps are mean + std·N(0, 1) (pooled z-scores).

    The schedule is float32 whatever the latents (timesteps() has no dtype), so σ²/(2t),
    Δt and the std are float32-rounded for float64 latents too: both dtypes are held
    to the float32 tolerance here."""
    z_all = []
    for seed, dtype, model in sampler_cases(kind, num_cases):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        num_steps, shift, noise_level, cfg = random_schedule(rng)
        n = rng.randint(1, 5)
        config = model.config
        noise = torch.randn(n, config.channels, config.image_size, config.image_size, generator=g,
                            dtype=dtype)  # fmt: skip
        tokens = torch.randint(1, VOCAB_SIZE, (n, 3), generator=g)
        traj = sample_sde(model, tokens, num_steps=num_steps, noise_level=noise_level,
                          shift=shift, cfg_scale=cfg, noise=noise, generator=g)  # fmt: skip
        assert torch.equal(traj.latents[:, 0], noise) and traj.log_probs.dtype == dtype
        close("sample_sde timesteps", traj.timesteps, ref_timesteps(num_steps, shift), F32, seed,
              scale=0.0)  # fmt: skip
        grid = traj.timesteps.tolist()
        want_sigmas = [ref_sigma(grid, i, noise_level) for i in range(num_steps)]
        close("sample_sde sigmas", traj.sigmas, want_sigmas, F32, seed, scale=0.0)
        every, subset = torch.arange(n), torch.randperm(n, generator=g)[: rng.randint(1, n)]
        other = rng.choice([None, cfg, 1.0, rng.uniform(0, 7)])
        for step in range(num_steps):
            want, scale, z = reference_log_probs(model, traj, step, every, noise_level, cfg)
            close(f"sample_sde log_probs {kind}", traj.log_probs[:, step], want, dtype, seed,
                  scale, tol=TOL[F32])  # fmt: skip
            z_all.append(z.flatten())
            want, scale, _ = reference_log_probs(model, traj, step, subset, noise_level,
                                                 cfg if other is None else other)  # fmt: skip
            got = step_log_prob(model, traj.rows(subset), step, cfg_scale=other).log_prob
            close(f"step_log_prob {kind}", got, want, dtype, seed, scale, tol=TOL[F32])
    z = torch.cat(z_all)
    assert z.numel() > 2000 and abs(float(z.mean())) < 0.05, float(z.mean())
    assert abs(float(z.square().mean()) - 1) < 0.05, float(z.square().mean())


# ----------------------------------------------------------------------------- guidance gradient


def grads(value: Tensor, weights: Tensor, model: nn.Module) -> Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad((value * weights).sum(), params)])


@pytest.mark.parametrize(("kind", "num_cases"),
                         [("toy-float32", 60), ("toy-float64", 60), ("flowdit", 6)])  # fmt: skip
def test_detached_uncond_gradient_matches_reference(kind: str, num_cases: int) -> None:
    """velocity(detach_uncond=True): the reference's values, and the gradient of the
    reference with v(∅) computed under no_grad (only the prompt branch trains);
    detach_uncond=False: the full gradient. At s ≠ 1 the two gradients differ."""
    num_differ = 0
    for seed, dtype, model in sampler_cases(kind, num_cases):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        _, _, _, cfg = random_schedule(rng)
        n, config = rng.randint(1, 4), model.config
        shape = (n, config.channels, config.image_size, config.image_size)
        x, weights = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(2))
        tokens, t = torch.randint(1, VOCAB_SIZE, (n, 3), generator=g), rng.random()
        want = {}
        for detach in (True, False):
            reference = ref_velocity(model, x, t, tokens, cfg, grad_uncond=not detach)
            want[detach] = grads(reference, weights, model)
        for detach in (True, False):
            v = velocity(model, x, torch.tensor(t), tokens, cfg, detach_uncond=detach)
            with torch.no_grad():
                close(f"velocity {kind}", v, ref_velocity(model, x, t, tokens, cfg), dtype, seed)
            got = grads(v, weights, model)
            scale = float(want[detach].abs().max()) + 1
            close(f"velocity grad detach={detach} {kind}", got, want[detach], dtype, seed, scale)
        gap = float((want[True] - want[False]).abs().max())
        assert (gap == 0) == (cfg == 1.0), (seed, cfg, gap)
        num_differ += gap > 0
    assert num_differ >= num_cases // 3


# ----------------------------------------------------------------------------- the loss


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
    torch.set_num_threads(1)  # as tests/conftest.py: small models, shared cores
    test_timesteps_match_reference()
    for dtype in (F32, F64):
        test_sde_sigmas_match_reference(dtype)
        test_transition_matches_reference(dtype)
        test_gaussian_log_prob_matches_reference(dtype)
    for kind, num in (("toy-float32", 120), ("toy-float64", 120), ("flowdit", 6)):
        test_sampler_log_probs_match_reference(kind, num)
        test_detached_uncond_gradient_matches_reference(kind, num // 2)
    for dtype in (F32, F64):
        test_step_loss_and_metrics_match_reference(dtype)
        test_kl_is_the_reference_kl_over_dt(dtype)
        test_step_loss_gradient_matches_reference(dtype)
    for choice in ("first", "random"):
        test_sample_groups_advantages_are_clipped_reference(choice)
    for key, worst in sorted(WORST.items()):
        print(f"{key:48s} {worst:.1e}")
