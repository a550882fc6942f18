"""Policy-gradient math in isolation (trainers/pg.py): advantages, the clipped
surrogate, aggregation, KL, GAE, the value loss. (Seeded random cases against
independent references: tests/test_pg_reference.py.)

Expected numbers are worked out by hand in the comments, not recomputed with the
code under test.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainers.pg import (
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    gae,
    group_advantages,
    kl_k3,
    zero_std_groups,
)

F64 = torch.float64


def t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected: Any, atol: float = 1e-5) -> None:
    expected_t = expected if isinstance(expected, torch.Tensor) else t(expected)
    assert torch.allclose(actual.to(F64), expected_t.to(F64), atol=atol), (actual, expected_t)


# ----------------------------------------------------------------------------- advantages

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # two groups of 4; the second is flat


def test_group_advantages_group_scope_std_norm() -> None:
    # Group 1: mean 0.5, centred ±0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3),
    # so ±0.5 / sqrt(1/3) = ±sqrt(3)/2 = ±0.8660. Group 2 is flat: exactly 0.
    a = math.sqrt(3) / 2
    adv = group_advantages(t(REWARDS), 4, "group", std_norm=True)
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])


def test_group_advantages_without_std_norm() -> None:
    adv = group_advantages(t(REWARDS), 4, "group", std_norm=False)
    close(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=0)


def test_group_advantages_batch_scope() -> None:
    # Baseline is still each group's mean; the std is the whole batch's: mean 0.75,
    # unbiased variance (6 · 0.25² + 2 · 0.75²) / 7 = 1.5 / 7, std 0.46291,
    # so ±0.5 / 0.46291 = ±1.08012.
    a = 0.5 / math.sqrt(1.5 / 7)
    adv = group_advantages(t(REWARDS), 4, "batch", std_norm=True)
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize(
    ("value", "size", "group_size"), [(0.0, 12, 4), (0.37, 12, 4), (0.3, 16, 8)]
)
def test_equal_rewards_give_exactly_zero(
    dtype: torch.dtype, scope: Any, std_norm: bool, value: float, size: int, group_size: int
) -> None:
    # (0.3, 16, 8) is the reported case: 0.0298 per row in float32, the group mean
    # one rounding step off 0.3 and divided by std ≈ 0 plus 1e-6.
    adv = group_advantages(torch.full((size,), value, dtype=dtype), group_size, scope, std_norm)
    assert torch.equal(adv, torch.zeros(size, dtype=dtype))


def test_group_advantages_bad_arguments() -> None:
    with pytest.raises(ValueError, match="7 rewards"):
        group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError, match="group_size must be at least 1"):
        group_advantages(torch.ones(4), 0)
    with pytest.raises(ValueError, match="unknown advantage scope"):
        group_advantages(torch.ones(4), 2, "prompt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="7 rewards"):
        zero_std_groups(torch.ones(7), 4)


def test_zero_std_groups_mixed() -> None:
    rewards = t([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0, 0, 1])
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True, False]


# ----------------------------------------------------------------------------- surrogate


def surrogate(ratio: float, adv: float, low: float, high: float) -> tuple[float, bool]:
    loss, clipped = clipped_surrogate(
        t([[math.log(ratio)]]), t([[0.0]]), t([[adv]]), clip_low=low, clip_high=high
    )
    return float(loss), bool(clipped)


def test_surrogate_inside_clip_range() -> None:
    for ratio in (0.85, 1.0, 1.15):
        for adv in (2.0, -2.0):
            loss, clipped = surrogate(ratio, adv, 0.2, 0.2)
            assert loss == pytest.approx(-adv * ratio)
            assert not clipped


def test_surrogate_clips_above_with_positive_advantage() -> None:
    # ratio 1.5 > 1.2, A = 2: max(-3.0, -2·1.2 = -2.4) = -2.4, clipped.
    loss, clipped = surrogate(1.5, 2.0, 0.2, 0.2)
    assert loss == pytest.approx(-2.4)
    assert clipped


def test_surrogate_clips_below_with_negative_advantage() -> None:
    # ratio 0.5 < 0.8, A = -2: max(1.0, 2·0.8 = 1.6) = 1.6, clipped.
    loss, clipped = surrogate(0.5, -2.0, 0.2, 0.2)
    assert loss == pytest.approx(1.6)
    assert clipped


def test_surrogate_asymmetric_clip_dapo() -> None:
    low, high = 0.2, 0.28
    # Above: 1.25 is inside [0.8, 1.28] (would be clipped at a symmetric 0.2) ...
    assert surrogate(1.25, 1.0, low, high) == (pytest.approx(-1.25), False)
    # ... 1.4 is clipped at 1.28, not at 1.2.
    assert surrogate(1.4, 1.0, low, high) == (pytest.approx(-1.28), True)
    # Below: the low side still clips at 0.8, not at 0.72.
    assert surrogate(0.75, -1.0, low, high) == (pytest.approx(0.8), True)
    assert surrogate(0.85, -1.0, low, high) == (pytest.approx(0.85), False)
    # A clip_low > clip_high case, to tell the two sides apart the other way round.
    assert surrogate(0.75, -1.0, 0.3, 0.1) == (pytest.approx(0.75), False)
    assert surrogate(1.15, 1.0, 0.3, 0.1) == (pytest.approx(-1.1), True)


def test_surrogate_keeps_unclipped_when_pessimistic() -> None:
    # A > 0 and ratio 0.5 < 0.8: -A·r = -1.0 > -A·0.8 = -1.6, so the unclipped term wins.
    assert surrogate(0.5, 2.0, 0.2, 0.2) == (pytest.approx(-1.0), False)
    # A < 0 and ratio 1.5 > 1.2: -A·r = 3.0 > 2.4, unclipped again.
    assert surrogate(1.5, -2.0, 0.2, 0.2) == (pytest.approx(3.0), False)


def test_surrogate_broadcasts_one_advantage_per_sequence() -> None:
    logp = t([[0.0, math.log(1.5)], [0.0, math.log(0.5)]])
    loss, clipped = clipped_surrogate(logp, torch.zeros_like(logp), t([[1.0], [-1.0]]), 0.2, 0.2)
    close(loss, [[-1.0, -1.2], [1.0, 0.8]])
    assert clipped.tolist() == [[False, True], [False, True]]


log_probs_st = st.floats(-6.0, 0.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    logp=log_probs_st,
    old_logp=log_probs_st,
    adv=st.floats(-5.0, 5.0, allow_nan=False),
    low=st.floats(0.0, 0.5),
    high=st.floats(0.0, 0.5),
)
def test_surrogate_property(
    logp: float, old_logp: float, adv: float, low: float, high: float
) -> None:
    lp, olp, a = t([[logp]]), t([[old_logp]]), t([[adv]])
    loss, clipped = clipped_surrogate(lp, olp, a, low, high)
    ratio = torch.exp(lp - olp)
    unclipped = -a * ratio
    assert float(loss) >= float(unclipped)
    if 1 - low <= float(ratio) <= 1 + high:
        assert float(loss) == float(unclipped)
        assert not bool(clipped)
    assert bool(clipped) == (float(loss) > float(unclipped))


# ----------------------------------------------------------------------------- aggregation

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # every real token weighs the same: (1 + 2 + 4) / 3
        ("token-mean", 7 / 3),
        # per sequence: (1 + 2) / 2 = 1.5 and 4 / 1 = 4; mean 2.75
        ("seq-mean-token-mean", 2.75),
        # per sequence: 1 + 2 = 3 and 4; mean 3.5
        ("seq-mean-token-sum", 3.5),
    ],
)
def test_aggregate(mode: Any, expected: float) -> None:
    assert float(aggregate(LOSS, MASK, mode)) == pytest.approx(expected)
    # Padding never counts, whatever its loss (inf and NaN included).
    for garbage in (1e6, math.inf, math.nan):
        noisy = LOSS.masked_fill(~MASK, garbage)
        assert float(aggregate(noisy, MASK, mode)) == pytest.approx(expected)


def test_aggregate_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq-mean'"):
        aggregate(LOSS, MASK, "seq-mean")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- KL


def test_kl_k3_zero_at_equal_log_probs() -> None:
    logp = t([-0.1, -2.0, -7.5])
    assert torch.equal(kl_k3(logp, logp), torch.zeros(3, dtype=F64))


@settings(max_examples=200, deadline=None)
@given(logp=st.floats(-10.0, 0.0), ref=st.floats(-10.0, 0.0))
def test_kl_k3_property(logp: float, ref: float) -> None:
    kl = float(kl_k3(t(logp), t(ref)))
    d = ref - logp
    assert kl == pytest.approx(math.exp(d) - d - 1, rel=1e-9, abs=1e-12)
    if abs(d) > 1e-4:  # far from rounding noise: d²/2 > 5e-9
        assert kl > 0


@pytest.mark.parametrize(
    ("dtype", "logp"),
    [
        # exp(d) - d - 1 computed as written cancels to -1.1e-16 / -6.0e-8 here.
        pytest.param(torch.float64, -2.985445084738752e-09, id="float64"),
        pytest.param(torch.float32, -1e-06, id="float32"),
    ],
)
def test_kl_k3_never_negative_for_tiny_differences(dtype: torch.dtype, logp: float) -> None:
    """The docstring's promise, "never negative", down at rounding level too.

    A negative KL (penalty or logged ``train/kl``) for near-identical policies is
    noise of the formula, not of the policies; ``expm1(d) - d`` has no such rounding.
    """
    kl = kl_k3(torch.tensor([logp], dtype=dtype), torch.zeros(1, dtype=dtype))
    assert float(kl) >= 0.0, float(kl)


@pytest.mark.parametrize("d", [1e-3, 3e-4])
def test_kl_k3_accurate_in_float32_for_close_policies(d: float) -> None:
    """Where k3 is used -- policy near its reference -- float32 keeps ~1% accuracy.

    d²/2 + d³/6 is exp(d) - d - 1 to 1e-12 here; computed as written in float32 the
    difference rounds to 0 at d = 3e-4 and is 5% off at d = 1e-3.
    """
    kl = kl_k3(torch.tensor([0.0]), torch.tensor([d]))
    assert float(kl) == pytest.approx(d * d / 2 + d**3 / 6, rel=1e-2)


# ----------------------------------------------------------------------------- GAE

VALUES = [[0.5, 0.6, 0.7]]
LAST_REWARD = [[0.0, 0.0, 1.0]]


def test_gae_gamma_1_lam_095() -> None:
    # delta_t = r_t + γ V_{t+1} - V_t, A_t = delta_t + γλ A_{t+1}, V after the end = 0
    # t=2: delta = 1 - 0.7 = 0.3;          A = 0.3
    # t=1: delta = 0.7 - 0.6 = 0.1;        A = 0.1 + 0.95 · 0.3 = 0.385
    # t=0: delta = 0.6 - 0.5 = 0.1;        A = 0.1 + 0.95 · 0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    adv, ret = gae(t(LAST_REWARD), t(VALUES), torch.ones(1, 3, dtype=torch.bool), 1.0, 0.95)
    close(adv, [[0.46575, 0.385, 0.3]], atol=1e-9)
    close(ret, [[0.96575, 0.985, 1.0]], atol=1e-9)


def test_gae_gamma_09_lam_1() -> None:
    # t=2: delta = 1 - 0.7 = 0.3;              A = 0.3
    # t=1: delta = 0.9 · 0.7 - 0.6 = 0.03;     A = 0.03 + 0.9 · 0.3 = 0.3
    # t=0: delta = 0.9 · 0.6 - 0.5 = 0.04;     A = 0.04 + 0.9 · 0.3 = 0.31
    # With λ = 1 that is the discounted return minus V: G = [0.81, 0.9, 1.0].
    adv, ret = gae(t(LAST_REWARD), t(VALUES), torch.ones(1, 3, dtype=torch.bool), 0.9, 1.0)
    close(adv, [[0.31, 0.3, 0.3]], atol=1e-9)
    close(ret, [[0.81, 0.9, 1.0]], atol=1e-9)


def test_gae_padding_is_zero_and_ends_the_sequence() -> None:
    # Row 0 is the 3-token example above padded to 5; row 1 has 2 real tokens with its
    # reward on token 1. Values and rewards on padding are garbage: they must not leak.
    rewards = t([[0.0, 0.0, 1.0, 9.0, 9.0], [0.0, 2.0, 9.0, 9.0, 9.0]])
    values = t([[0.5, 0.6, 0.7, 5.0, 5.0], [1.0, 1.5, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, 1.0, 0.95)
    # Row 1: t=1: delta = 2 - 1.5 = 0.5, A = 0.5; t=0: delta = 1.5 - 1 = 0.5,
    # A = 0.5 + 0.95 · 0.5 = 0.975; returns [1.975, 2.0].
    close(adv, [[0.46575, 0.385, 0.3, 0, 0], [0.975, 0.5, 0, 0, 0]], atol=1e-9)
    close(ret, [[0.96575, 0.985, 1.0, 0, 0], [1.975, 2.0, 0, 0, 0]], atol=1e-9)
    assert torch.equal(adv[~mask], torch.zeros(5, dtype=F64))
    assert torch.equal(ret[~mask], torch.zeros(5, dtype=F64))


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-2, 2), min_size=4, max_size=4),
    values=st.lists(st.floats(-2, 2), min_size=4, max_size=4),
    length=st.integers(1, 4),
)
def test_gae_monte_carlo(rewards: list[float], values: list[float], length: int) -> None:
    # γ = λ = 1: advantage = reward-to-go − value, return = reward-to-go.
    mask = torch.arange(4)[None] < length
    adv, ret = gae(t([rewards]), t([values]), mask, 1.0, 1.0)
    to_go = [sum(rewards[i:length]) if i < length else 0.0 for i in range(4)]
    close(ret, [to_go], atol=1e-9)
    expected = [
        g - v if i < length else 0.0 for i, (g, v) in enumerate(zip(to_go, values, strict=True))
    ]
    close(adv, [expected], atol=1e-9)


# ----------------------------------------------------------------------------- value loss


def test_clipped_value_loss_takes_the_max() -> None:
    # v = 2, v_old = 0, R = 2, clip 0.5: unclipped (2 - 2)² = 0, clipped v = 0.5 gives
    # (0.5 - 2)² = 2.25, so the loss is 0.5 · 2.25 = 1.125 (clipping made it larger).
    loss = clipped_value_loss(t([2.0]), t([0.0]), t([2.0]), 0.5)
    close(loss, [1.125], atol=1e-12)
    # Within the clip range both terms agree: 0.5 · (0.3 - 1)² = 0.245.
    close(clipped_value_loss(t([0.3]), t([0.0]), t([1.0]), 0.5), [0.245], atol=1e-12)
    # Clipped but closer: v = 3, v_old = 0, R = 0.4: max((2.6)², (0.1)²) → 0.5 · 6.76.
    close(clipped_value_loss(t([3.0]), t([0.0]), t([0.4]), 0.5), [3.38], atol=1e-12)
