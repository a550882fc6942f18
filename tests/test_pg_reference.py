"""trainers/pg.py against references written independently from verl's ``core_algos``
semantics: compute_grpo_outcome_advantage, agg_loss, compute_gae_advantage_return,
compute_value_loss, compute_policy_loss (clip-higher and dual-clip), the decoupled
(off-policy) variant, and kl_penalty "low_var_kl" (k3, clamped).

Each reference is plain Python on floats, one element at a time, in the shape of the
published definition (GAE as the discounted sum of TD errors, not the recursion;
GRPO statistics in exact rational arithmetic; the policy losses one token at a time),
and never calls trainers/pg.py. Each test runs NUM_CASES seeded random cases per
dtype: shapes, left/right padding, holes, empty rows, constant groups, float32 and
float64. float32 inputs are compared with the reference on the same (rounded) values,
so only the code's rounding counts.

``python -m tests.test_pg_reference`` prints the worst difference seen per function.
"""

from __future__ import annotations

import math
import random
import statistics
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import Tensor

from trainers.pg import (
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    decoupled_surrogate,
    gae,
    group_advantages,
    kl_k3,
)

F32, F64 = torch.float32, torch.float64
DTYPES = [pytest.param(F32, id="float32"), pytest.param(F64, id="float64")]
NUM_CASES = 300
# Relative tolerance per dtype; absolute tolerance is this times the inputs' scale.
TOL = {F32: 2e-5, F64: 1e-10}
# Worst |code − reference| / (1 + |reference|) per (function, dtype), for the report.
WORST: dict[str, float] = {}

Matrix = list[list[float]]
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def check(name: str, actual: Tensor, expected: Any, dtype: torch.dtype, seed: int,
          scale: float | Tensor = 1.0, slack: float | Tensor = 0.0) -> None:  # fmt: skip
    """``actual`` (code under test) matches ``expected`` (reference) within rounding:
    TOL relative to the result and to the inputs' ``scale``, plus ``slack`` where a
    function's own conditioning magnifies rounding."""
    assert actual.dtype == dtype, (name, actual.dtype)
    want = torch.tensor(expected, dtype=F64)
    got = actual.detach().to(F64)
    error = (got - want).abs()
    if want.numel():
        key = f"{name} {str(dtype).removeprefix('torch.')}"
        WORST[key] = max(WORST.get(key, 0.0), float((error / (1 + want.abs())).max()))
    allowed = TOL[dtype] * (want.abs() + scale) + slack
    bad = ~(error <= allowed)  # NaN counts as bad
    assert not bad.any(), f"{name}, seed {seed}: got {got[bad]}, want {want[bad]}"


def random_mask(rng: random.Random, rows: int, cols: int) -> list[list[bool]]:
    """Per row one layout: right or left padding, random holes, empty, or full."""
    mask = []
    for _ in range(rows):
        n = rng.randint(0, cols)
        layout = rng.choice(["right", "left", "holes", "holes", "empty", "full"])
        mask.append(
            [i < n for i in range(cols)] if layout == "right"
            else [i >= cols - n for i in range(cols)] if layout == "left"
            else [rng.random() < 0.6 for _ in range(cols)] if layout == "holes"
            else [layout == "full"] * cols
        )  # fmt: skip
    return mask


def garbage(rng: random.Random) -> float:
    """What padding may hold: large, infinite or NaN values that must never count."""
    return rng.choice([1e6, -1e6, math.inf, -math.inf, math.nan, 7.0])


# ----------------------------------------------------------------------------- GRPO


def ref_grpo(rewards: list[float], n: int, scope: str, std_norm: bool) -> list[float]:
    """compute_grpo_outcome_advantage: (r − group mean) / (std + 1e-6), unbiased std of
    the group, or of the whole batch for scope "batch" (LitePPO's group-mean,
    batch-std). Mean and centring are exact (fractions), so a flat group is 0."""
    batch_std = statistics.stdev(rewards)
    out = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        mean = sum(map(Fraction, group)) / n
        std = statistics.stdev(group) if scope == "group" else batch_std
        for r in group:
            centred = float(Fraction(r) - mean)
            out.append(centred / (std + 1e-6) if std_norm else centred)
    return out


def random_group(rng: random.Random, n: int) -> list[float]:
    kind = rng.choice(["uniform", "binary", "flat", "flat", "near-flat", "offset"])
    base = rng.uniform(-2, 2)
    if kind == "uniform":
        return [rng.uniform(-2, 2) for _ in range(n)]
    if kind == "binary":
        return [float(rng.random() < 0.5) for _ in range(n)]
    if kind == "flat":
        return [base] * n
    if kind == "near-flat":  # a few float32 ulps apart: cancellation in the mean
        return [base + rng.choice([0.0, 3e-7, -3e-7]) for _ in range(n)]
    return [1000 + rng.uniform(-1, 1) for _ in range(n)]


def grpo_slack(values: list[float], n: int, scope: str, std_norm: bool) -> Tensor:
    """Centring near-equal rewards cancels: float64 rounding of the mean (the code works
    in float64 for both dtypes) grows by |r| / (std + eps). Tolerance, not reference."""
    grouped = torch.tensor(values, dtype=F64).view(-1, n)
    std = grouped.std(dim=1, keepdim=True) if scope == "group" else grouped.std()
    growth = grouped.abs().amax(dim=1, keepdim=True) / (std + 1e-6 if std_norm else 1.0)
    return (1e-14 * growth).expand_as(grouped).reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_advantages_match_reference(dtype: torch.dtype) -> None:
    num_flat = 0
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        n, groups = rng.randint(2, 8), rng.randint(1, 6)
        scope, std_norm = rng.choice(["group", "batch"]), rng.random() < 0.8
        rewards = torch.tensor(
            [r for _ in range(groups) for r in random_group(rng, n)], dtype=dtype
        )
        got = group_advantages(rewards, n, scope, std_norm)  # type: ignore[arg-type]
        values = rewards.tolist()
        expected = ref_grpo(values, n, scope, std_norm)
        slack = grpo_slack(values, n, scope, std_norm)
        check("group_advantages", got, expected, dtype, seed, slack=slack)
        for g in range(groups):  # equal rewards: exactly 0, whatever else is in the batch
            if len(set(values[g * n : (g + 1) * n])) == 1:
                num_flat += 1
                assert not got[g * n : (g + 1) * n].any(), (seed, g, got)
    assert num_flat > 200  # the generator does produce flat groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("std_norm", [True, False])
def test_constant_groups_exactly_zero_any_layout(
    dtype: torch.dtype, scope: Any, std_norm: bool
) -> None:
    """The reported case (two groups of eight 0.3s gave 0.0298 in float32), then 200
    random constant groups in [−2, 2] placed among 0-3 other groups, flat or not."""
    assert not group_advantages(torch.full((16,), 0.3, dtype=dtype), 8, scope, std_norm).any()
    for seed in range(200):
        rng = random.Random(10_000 + seed)
        n, before, after = rng.randint(2, 16), rng.randint(0, 3), rng.randint(0, 3)
        others = [random_group(rng, n) for _ in range(before + after)]
        flat = [rng.uniform(-2, 2)] * n
        rows = [*others[:before], flat, *others[before:]]
        rewards = torch.tensor([r for group in rows for r in group], dtype=dtype)
        got = group_advantages(rewards, n, scope, std_norm)
        assert not got[before * n : (before + 1) * n].any(), (seed, got)


def test_group_of_one_is_zero_not_nan() -> None:
    """Documented choice: a group of one is a flat group (verl: the raw reward)."""
    rewards = torch.tensor([0.5, -1.0, 2.0])
    for scope in ("group", "batch"):
        for std_norm in (True, False):
            got = group_advantages(rewards, 1, scope, std_norm)  # type: ignore[arg-type]
            assert torch.equal(got, torch.zeros(3)), (scope, std_norm, got)


# ----------------------------------------------------------------------------- aggregation


def ref_agg_loss(loss: Matrix, mask: list[list[bool]], mode: str) -> float:
    """agg_loss: token-mean over all real tokens; seq-mean-token-mean / -token-sum over
    the rows that have tokens (rows without any are dropped, as in current verl);
    0 when nothing counts."""
    rows = [
        [x for x, m in zip(xs, ms, strict=True) if m] for xs, ms in zip(loss, mask, strict=True)
    ]
    if mode == "token-mean":
        tokens = [x for row in rows for x in row]
        return math.fsum(tokens) / len(tokens) if tokens else 0.0
    per_row = [math.fsum(r) / (len(r) if mode == "seq-mean-token-mean" else 1) for r in rows if r]
    return math.fsum(per_row) / len(per_row) if per_row else 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference(dtype: torch.dtype, mode: Any) -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        rows, cols = rng.randint(1, 8), rng.randint(1, 12)
        mask = random_mask(rng, rows, cols)
        loss = [[rng.uniform(-10, 10) if m else garbage(rng) for m in row] for row in mask]
        loss_t = torch.tensor(loss, dtype=dtype)
        # Compare on the rounded values, and with garbage kept out of the reference.
        real = [[x if m else 0.0 for x, m in zip(xs, ms, strict=True)]
                for xs, ms in zip(loss_t.tolist(), mask, strict=True)]  # fmt: skip
        got = aggregate(loss_t, torch.tensor(mask), mode)
        check(f"aggregate {mode}", got, ref_agg_loss(real, mask, mode), dtype, seed, 10 * cols)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_empty_rows_are_dropped(mode: Any) -> None:
    """Adding rows with no tokens leaves every mode's loss unchanged; no tokens at all: 0."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    padded = aggregate(torch.cat([loss, 9 * loss]), torch.cat([mask, torch.zeros_like(mask)]), mode)
    assert float(padded) == float(aggregate(loss, mask, mode))
    assert float(aggregate(loss, torch.zeros_like(mask), mode)) == 0.0


# ----------------------------------------------------------------------------- GAE


def ref_gae(rewards: list[float], values: list[float], mask: list[bool], gamma: float,
            lam: float) -> tuple[list[float], list[float]]:  # fmt: skip
    """compute_gae_advantage_return on one row: masked positions are skipped (the TD
    error of a real token bootstraps from the next real token's value, 0 after the
    last). A_t = Σ_k (γλ)^k δ_{t+k} over the real tokens; returns = A + V; 0 on masked
    positions (corun's documented choice)."""
    real = [t for t, m in enumerate(mask) if m]
    nxt = [values[real[i + 1]] if i + 1 < len(real) else 0.0 for i in range(len(real))]
    deltas = [rewards[t] + gamma * v - values[t] for t, v in zip(real, nxt, strict=True)]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for i, t in enumerate(real):
        adv[t] = math.fsum((gamma * lam) ** k * d for k, d in enumerate(deltas[i:]))
        ret[t] = adv[t] + values[t]
    return adv, ret


@pytest.mark.parametrize("dtype", DTYPES)
def test_gae_matches_reference(dtype: torch.dtype) -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        rows, cols = rng.randint(1, 6), rng.randint(1, 12)
        gamma, lam = rng.choice([1.0, 0.99, rng.uniform(0, 1)]), rng.choice([1.0, 0.95, 0.0])
        mask = random_mask(rng, rows, cols)
        rewards = [[rng.uniform(-2, 2) if m else garbage(rng) for m in row] for row in mask]
        values = [[rng.uniform(-2, 2) if m else garbage(rng) for m in row] for row in mask]
        r_t, v_t = torch.tensor(rewards, dtype=dtype), torch.tensor(values, dtype=dtype)
        adv, ret = gae(r_t, v_t, torch.tensor(mask), gamma, lam)
        expected = [
            ref_gae(r, v, m, gamma, lam)
            for r, v, m in zip(r_t.tolist(), v_t.tolist(), mask, strict=True)
        ]
        check("gae advantages", adv, [a for a, _ in expected], dtype, seed, 4 * cols)
        check("gae returns", ret, [r for _, r in expected], dtype, seed, 4 * cols)


def test_gae_left_padding_and_holes_equal_the_packed_sequence() -> None:
    """The same three tokens, right-padded, left-padded and with holes: same advantages
    on the real tokens (a hole used to end the sequence early)."""
    rewards, values = [0.0, 0.5, 1.0], [0.5, 0.6, 0.7]
    layouts = [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 0, 1], [0, 1, 1, 0, 1]]
    results = []
    for layout in layouts:
        r, v = [9.0] * 5, [9.0] * 5  # garbage on masked positions
        real = [i for i, m in enumerate(layout) if m]
        for i, t in enumerate(real):
            r[t], v[t] = rewards[i], values[i]
        adv, _ = gae(torch.tensor([r]), torch.tensor([v]), torch.tensor([layout]), 0.9, 0.95)
        results.append(adv[0, real])
    for other in results[1:]:
        assert torch.equal(other, results[0]), results


# ----------------------------------------------------------------------------- value loss


def ref_value_loss(v: float, old: float, ret: float, clip: float) -> float:
    """compute_value_loss per token: 0.5 · max((v − R)², (clip(v, old − c, old + c) − R)²)."""
    v_clipped = min(max(v, old - clip), old + clip)
    return 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_loss_matches_reference(dtype: torch.dtype) -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        size, clip = rng.randint(1, 16), rng.choice([0.2, 0.5, rng.uniform(0.01, 2)])
        old = [rng.uniform(-3, 3) for _ in range(size)]
        # Values near and far from the old ones, so both sides of the clip are hit.
        new = [o + rng.choice([0.1, 1.0, 4.0]) * rng.uniform(-1, 1) for o in old]
        ret = [rng.uniform(-3, 3) for _ in range(size)]
        v, o, r = (torch.tensor(x, dtype=dtype) for x in (new, old, ret))
        expected = [
            ref_value_loss(*args, clip)
            for args in zip(v.tolist(), o.tolist(), r.tolist(), strict=True)
        ]
        check("clipped_value_loss", clipped_value_loss(v, o, r, clip), expected, dtype, seed, 50)


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
        test_group_advantages_match_reference(dtype)
        for mode in MODES:
            test_aggregate_matches_reference(dtype, mode)
        test_gae_matches_reference(dtype)
        test_value_loss_matches_reference(dtype)
        test_clipped_surrogate_matches_reference(dtype)
        test_decoupled_surrogate_matches_reference(dtype)
        test_kl_k3_matches_reference(dtype)
    for key, worst in sorted(WORST.items()):
        print(f"{key:40s} {worst:.1e}")
