"""trainers/pg.py's policy losses and KL against independent references from verl's
``core_algos`` semantics: compute_policy_loss (clip-higher and dual-clip), the
decoupled (off-policy) variant, and kl_penalty "low_var_kl" (k3, clamped).

As in test_pg_reference.py: plain-Python references, one token at a time, NUM_CASES
seeded random cases per dtype, float32 inputs compared on their rounded values.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.test_pg_reference import DTYPES, F32, F64, NUM_CASES, TOL, WORST, check
from trainers.pg import clipped_surrogate, decoupled_surrogate, kl_k3

# ----------------------------------------------------------------------------- surrogate


def ref_policy_loss(logp: float, old: float, adv: float, low: float, high: float,
                    c: float | None) -> tuple[float, bool, float]:  # fmt: skip
    """compute_policy_loss for one token: r = exp(logp − old) (verl clamps the log-ratio
    to ±20; the cases stay inside), loss max(−A·r, −A·clip(r, 1 − low, 1 + high)), and
    with dual clip, for A < 0, min(that, −A·c). Returns (loss, clipped, margin): clipped
    is either clip binding; margin, r's relative distance from the nearest bound that
    decides it (rounding may decide a near-tie either way)."""
    ratio = math.exp(max(-20.0, min(20.0, logp - old)))
    plain = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss, bit = max(plain, clipped), clipped > plain
    bounds = [1 - low, 1 + high] + ([c] if c is not None and adv < 0 else [])
    margin = math.inf if adv == 0 else min(abs(ratio - b) / ratio for b in bounds)
    if c is not None and adv < 0 and loss > -adv * c:
        loss, bit = -adv * c, True
    return loss, bit, margin


def random_policy_case(rng: random.Random, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """(B, T) log-probs with log-ratios near 0, at clip-range size, and far (up to ±15:
    past the dual clip's c); advantages per sequence (B, 1) or per token, some zero."""
    rows, cols = rng.randint(1, 4), rng.randint(1, 8)
    spread = rng.choice([1e-4, 0.1, 0.3, 2.0, 15.0])
    logp = [[rng.uniform(-8, 0) for _ in range(cols)] for _ in range(rows)]
    old = [[x - rng.uniform(-spread, spread) for x in row] for row in logp]
    per_token = rng.random() < 0.5
    adv = [[rng.choice([0.0, rng.uniform(-3, 3)]) for _ in range(cols if per_token else 1)]
           for _ in range(rows)]  # fmt: skip
    return {
        k: torch.tensor(v, dtype=dtype) for k, v in (("logp", logp), ("old", old), ("adv", adv))
    }


def ref_on_case(case: dict[str, torch.Tensor], low: float, high: float, c: float | None,
                ) -> tuple[list[list[float]], list[list[bool]], list[list[float]]]:  # fmt: skip
    logp, old = case["logp"].tolist(), case["old"].tolist()
    adv = case["adv"].expand_as(case["logp"]).tolist()
    out = [[ref_policy_loss(*args, low, high, c) for args in zip(*rows, strict=True)]
           for rows in zip(logp, old, adv, strict=True)]  # fmt: skip
    return ([[x[0] for x in row] for row in out], [[x[1] for x in row] for row in out],
            [[x[2] for x in row] for row in out])  # fmt: skip


def random_clip(rng: random.Random) -> tuple[float, float, float | None]:
    low = rng.choice([0.2, rng.uniform(0.0, 0.5)])
    high = rng.choice([0.2, 0.28, rng.uniform(0.0, 0.5)])
    return low, high, rng.choice([None, 3.0, rng.uniform(1.01, 10.0)])


def check_bits(name: str, bits: torch.Tensor, want: list[list[bool]],
               margins: list[list[float]], dtype: torch.dtype, seed: int) -> None:  # fmt: skip
    """Where clipping bit must agree, except at near-ties, which rounding may decide."""
    decided = torch.tensor(margins, dtype=F64) > 10 * TOL[dtype]
    want_t = torch.tensor(want, dtype=torch.bool)
    assert torch.equal(bits[decided], want_t[decided]), (name, seed, bits, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_surrogate_matches_reference(dtype: torch.dtype) -> None:
    num_dual = 0
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        case, (low, high, c) = random_policy_case(rng, dtype), random_clip(rng)
        loss, bits = clipped_surrogate(
            case["logp"], case["old"], case["adv"], low, high, clip_ratio_c=c
        )
        want, want_bits, margins = ref_on_case(case, low, high, c)
        check("clipped_surrogate", loss, want, dtype, seed, scale=3.0)
        check_bits("clipped_surrogate", bits, want_bits, margins, dtype, seed)
        if c is not None:  # count tokens whose loss is the dual clip's −A·c
            want_t = torch.tensor(want, dtype=F64)
            cap = (-case["adv"].to(F64) * c).expand_as(want_t)
            num_dual += int(((cap > 0) & (want_t == cap)).sum())
    assert num_dual > 50  # the dual clip did bind in the generated cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoupled_surrogate_matches_reference(dtype: torch.dtype) -> None:
    """Decoupled PPO: min(π_prox / π_behav, cap) times the surrogate against the
    proximal policy (clipping and dual clip included)."""
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        case, (low, high, c) = random_policy_case(rng, dtype), random_clip(rng)
        cap = rng.choice([1.0, 2.0, rng.uniform(1.0, 5.0)])
        stale = rng.choice([0.0, 0.05, 1.0])
        behaviour = case["old"] + torch.empty_like(case["old"]).uniform_(
            -stale, stale, generator=torch.Generator().manual_seed(seed)
        )
        loss, bits, weights = decoupled_surrogate(
            case["logp"], case["old"], behaviour, case["adv"], low, high, cap, clip_ratio_c=c
        )
        prox_behav = zip(case["old"].tolist(), behaviour.tolist(), strict=True)
        want_w = [[min(math.exp(p - b), cap) for p, b in zip(*rows, strict=True)]
                  for rows in prox_behav]  # fmt: skip
        plain, want_bits, margins = ref_on_case(case, low, high, c)
        want = [[w * x for w, x in zip(ws, xs, strict=True)]
                for ws, xs in zip(want_w, plain, strict=True)]  # fmt: skip
        check("decoupled_surrogate weights", weights, want_w, dtype, seed)
        check("decoupled_surrogate", loss, want, dtype, seed, scale=3.0 * cap)
        check_bits("decoupled_surrogate", bits, want_bits, margins, dtype, seed)


def test_dual_clip_caps_negative_advantages_only() -> None:
    # ratio e^3 ≈ 20.1 > c = 3: A = −2 → min(2 · 20.1, 2 · 3) = 6, clipped; A = +2 → the
    # upper clip, −2 · 1.28 = −2.56, whatever c is.
    logp, old = torch.tensor([[3.0, 3.0]]), torch.zeros(1, 2)
    loss, bits = clipped_surrogate(logp, old, torch.tensor([[-2.0, 2.0]]), 0.2, 0.28,
                                   clip_ratio_c=3.0)  # fmt: skip
    assert torch.allclose(loss, torch.tensor([[6.0, -2.56]])) and bits.all()
    plain, plain_bits = clipped_surrogate(logp, old, torch.tensor([[-2.0, 2.0]]), 0.2, 0.28)
    assert plain[0, 0] == pytest.approx(2 * math.exp(3.0)) and not plain_bits[0, 0]
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        clipped_surrogate(logp, old, torch.ones(1, 1), 0.2, 0.2, clip_ratio_c=1.0)


# ----------------------------------------------------------------------------- KL


def ref_k3(logp: float, ref: float, clamp: float | None) -> float:
    """kl_penalty "low_var_kl": d = ref − logp, exp(d) − d − 1. With a clamp as verl's:
    d clamped to ±20, the estimate to [−clamp, clamp] (verl: 10). Small d by its
    Taylor series, so the reference does not cancel where the code must not."""
    d = ref - logp
    if clamp is not None:
        d = max(-20.0, min(20.0, d))
    if abs(d) < 1e-2:
        k3 = sum(d**k / math.factorial(k) for k in range(2, 8))
    else:
        k3 = math.exp(d) - d - 1
    return k3 if clamp is None else max(-clamp, min(clamp, k3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_k3_matches_reference(dtype: torch.dtype) -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        clamp = rng.choice([None, None, 10.0, rng.uniform(0.5, 15.0)])
        spread = rng.choice([1e-4, 1e-2, 1.0, 5.0, 40.0])
        logp = torch.tensor([rng.uniform(-10, 0) for _ in range(16)], dtype=dtype)
        ref = logp + torch.tensor([rng.uniform(-spread, spread) for _ in range(16)], dtype=dtype)
        want = [ref_k3(a, b, clamp) for a, b in zip(logp.tolist(), ref.tolist(), strict=True)]
        # Relative to the two terms that cancel (e^d − 1 and d), as any difference is.
        d = ref.to(F64) - logp.to(F64)
        scale = d.abs() + torch.expm1(d).abs()
        check("kl_k3", kl_k3(logp, ref, clamp=clamp), want, dtype, seed, scale=scale)


def test_kl_k3_clamp_keeps_gradients_finite() -> None:
    """Capped tokens have zero gradient, even where exp(d) overflows float32."""
    logp = torch.tensor([-200.0, 200.0, -1.0, -0.5], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -0.5, -0.5])
    kl = kl_k3(logp, ref, clamp=10.0)
    kl.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert kl[:2].tolist() == [10.0, 10.0] and logp.grad[:2].tolist() == [0.0, 0.0]
    assert logp.grad[2] == pytest.approx(1 - math.exp(0.5))  # d/dlogp of e^d − d − 1
    with pytest.raises(ValueError, match="KL clamp must be positive"):
        kl_k3(logp, ref, clamp=0.0)


if __name__ == "__main__":
    for dtype in (F32, F64):
        test_clipped_surrogate_matches_reference(dtype)
        test_decoupled_surrogate_matches_reference(dtype)
        test_kl_k3_matches_reference(dtype)
    for key, worst in sorted(WORST.items()):
        print(f"{key:40s} {worst:.1e}")
