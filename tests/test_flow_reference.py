"""trainers/diffusion/sampling.py against references written independently from the
published semantics of the official Flow-GRPO (yifan123/flow_grpo,
``sde_step_with_logprob`` in flow_grpo/diffusers_patch/sd3_sde_with_logprob.py): the
shifted time grid, σ_t, the SDE transition's mean and std, its Gaussian log-density,
the sampler's recorded log-probs and their recomputation, and the gradient of the
guided velocity with the unconditional branch detached. The loss side (flow_rl.py)
is in test_flow_reference_losses.py.

Each reference is float64 and written in the shape of the published formula (the
mean as ``x·(1 + σ²/(2t)·Δt) + v·(1 + σ²(1 − t)/(2t))·Δt``, not corun's grouping;
log-densities summed exactly with math.fsum) and never calls the functions under
test. Models are called, not tested: the reference velocity runs the conditional and
unconditional branches as two separate calls. Seeded random cases per dtype: shapes,
grids with shift, noise levels, guidance scales including 1, and the first (t = 1
clamp) and last steps; float32 inputs are compared on their rounded values.

Convention (corun's): ``x_t = (1 − t)·x0 + t·ε``, ``v = ε − x0``, t from 1 to 0, Δt < 0.

``python -m tests.test_flow_reference`` prints the worst difference seen per function.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import Tensor, nn

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
    for key, worst in sorted(WORST.items()):
        print(f"{key:48s} {worst:.1e}")
