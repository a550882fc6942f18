"""Policy-gradient math in isolation (trainers/pg.py), top-p sampling log-probs, the
rollout engine's masks and behaviour log-probs, and GRPO's dynamic-sampling refill.

Expected numbers are worked out by hand in the comments, not recomputed with the
code under test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import corun
from tests.conftest import make_config
from trainers.grpo import GRPOBatch, GRPOTrainer
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.model import top_p_log_probs
from trainers.lm.policy import build_policy, response_logprobs
from trainers.lm.rl import Scored
from trainers.lm.tasks import EOS, PAD, TASKS, encode_prompts
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


@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("value", [0.0, 0.37, 1.0])
def test_equal_rewards_give_exactly_zero(scope: Any, std_norm: bool, value: float) -> None:
    adv = group_advantages(torch.full((12,), value), 4, scope, std_norm)
    assert torch.equal(adv, torch.zeros(12))


def test_group_advantages_bad_size() -> None:
    with pytest.raises(ValueError, match="7 rewards"):
        group_advantages(torch.ones(7), 4)


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
    # Padding never counts, whatever its loss.
    noisy = LOSS.masked_fill(~MASK, 1e6)
    assert float(aggregate(noisy, MASK, mode)) == pytest.approx(expected)


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


# ----------------------------------------------------------------------------- top-p


def test_top_p_one_is_log_softmax() -> None:
    logits = torch.randn(3, 15, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top_p_log_probs(logits, 1.0), torch.log_softmax(logits, dim=-1))


def test_small_top_p_keeps_only_the_argmax() -> None:
    logits = torch.randn(4, 15, generator=torch.Generator().manual_seed(1))
    lp = top_p_log_probs(logits, 1e-3)
    best = logits.argmax(dim=-1)
    assert torch.equal(lp.gather(1, best[:, None]).squeeze(1), torch.zeros(4))
    others = torch.ones_like(lp, dtype=torch.bool).scatter(1, best[:, None], False)
    assert torch.isinf(lp[others]).all() and (lp[others] < 0).all()


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_kept_mass(top_p: float) -> None:
    logits = 2 * torch.randn(8, 15, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, dim=-1)
    lp = top_p_log_probs(logits, top_p)
    kept = torch.isfinite(lp)
    kept_mass = (probs * kept).sum(dim=-1)
    assert (kept_mass >= top_p - 1e-6).all()
    # The smallest such set: without its least likely token it falls short of top_p.
    smallest = probs.masked_fill(~kept, float("inf")).min(dim=-1).values
    assert (kept_mass - smallest < top_p).all()
    # Renormalised over the kept tokens, in proportion to the original probabilities.
    assert torch.allclose(lp.exp().sum(dim=-1), torch.ones(8), atol=1e-5)
    assert torch.allclose(lp.exp(), probs * kept / kept_mass[:, None], atol=1e-6)


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_policy() -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_policy(32, 1, 2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_masks_and_behaviour_logprobs(tiny_policy: Any, temperature: float) -> None:
    task = TASKS["sort"]
    prompts = encode_prompts(["314259>", "000111>", "987654>", "555555>"])
    engine = LocalEngine(tiny_policy)
    engine.update_weights(tiny_policy.state_dict(), 3)
    gen = torch.Generator().manual_seed(1234)
    out = engine.generate(prompts, 8, task.max_answer_len + 1, temperature, 1.0, generator=gen)

    n_rows = 32
    assert out.prompt_ids.shape == (n_rows, prompts.shape[1])
    assert torch.equal(out.prompt_ids, prompts.repeat_interleave(8, dim=0))
    assert out.version == 3
    is_eos = out.response_ids == EOS
    has_eos = is_eos.any(dim=1)
    assert torch.equal(out.truncated, ~has_eos)
    # Both kinds of rows occur with this seed, so both branches are checked.
    assert has_eos.any() and (~has_eos).any()
    for row in range(n_rows):
        mask = out.response_mask[row]
        ids = out.response_ids[row]
        if has_eos[row]:
            first = int(is_eos[row].nonzero()[0])
            expected = torch.arange(ids.numel()) <= first
        else:
            expected = torch.ones(ids.numel(), dtype=torch.bool)
        assert torch.equal(mask, expected), row
        assert (ids[~mask] == PAD).all()
        assert (out.logprobs[row][~mask] == 0).all()
        assert (out.logprobs[row][mask] < 0).all()

    # The "ratio is 1 for unchanged weights" invariant: the trainer's log-probs of the
    # same sequences with the same weights and temperature equal the behaviour ones.
    logp, _, _ = response_logprobs(tiny_policy, out.sequences, out.prompt_ids.shape[1], temperature)
    logp = logp.masked_fill(~out.response_mask, 0.0)
    assert torch.allclose(logp, out.logprobs, atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_ratio_is_one_for_unchanged_weights(tmp_path: Path, top_p: float) -> None:
    """Through the trainer: sample, then the policy loss with the same weights.

    With every ratio 1 and A = -1 the per-token loss is exactly 1, nothing clips and
    the KL estimate to the behaviour policy is 0 -- with top-p sampling too, where
    the behaviour log-probs come from the truncated distribution.
    """
    with torch.random.fork_rng():
        torch.manual_seed(0)
        trainer = grpo_trainer(tmp_path, dynamic_sampling=False, top_p=top_p)
        scored, _ = trainer.sample_and_score(trainer.dataset().batch(0))
    rows = torch.arange(scored.rollouts.prompt_ids.shape[0])
    with torch.no_grad():
        loss, metrics, _ = trainer.policy_loss(scored.rollouts, rows, -torch.ones(len(rows), 1))
    assert metrics["train/clip_ratio"] == 0.0
    assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-5)
    assert float(loss) == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- GRPO refill

GROUP = 4  # samples_per_prompt
WANTED = 4  # data.batch_size: groups per step
FLAT, INFO = "flat", "info"


def grpo_trainer(tmp_path: Path, **overrides: Any) -> GRPOTrainer:
    trainer_cfg = {
        "kind": "grpo", "d_model": 32, "n_heads": 2, "n_layers": 1, "dynamic_sampling": True,
        "max_sampling_rounds": 3, "samples_per_prompt": GROUP, "eval_size": 8, **overrides,
    }  # fmt: skip
    config = make_config(tmp_path, trainer_cfg, data={"batch_size": WANTED})
    trainer = GRPOTrainer(config)
    trainer.setup(corun.SetupContext(config))
    return trainer


def scored_round(round_index: int, kinds: list[str], width: int) -> Scored:
    """One scripted round: ``kinds`` per group; group ``g`` of round ``r`` is tagged
    ``10·r + g`` in its prompt ids so the test can tell which groups were kept."""
    rows = len(kinds) * GROUP
    tags = torch.tensor([10 * round_index + g for g in range(len(kinds))])
    rewards = torch.cat([
        torch.ones(GROUP) if kind == FLAT else torch.tensor([1.0, 0.0, 0.5, 0.0])
        for kind in kinds
    ])  # fmt: skip
    rollouts = Rollouts(
        prompt_ids=tags.repeat_interleave(GROUP)[:, None].repeat(1, 7),
        response_ids=torch.full((rows, width), 5),
        response_mask=torch.ones(rows, width, dtype=torch.bool),
        logprobs=torch.full((rows, width), -1.0),
        truncated=torch.zeros(rows, dtype=torch.bool),
        token_versions=torch.full((rows, width), round_index),
        version=round_index,
    )
    return Scored(rollouts, [f"p{int(tag)}" for tag in tags.repeat_interleave(GROUP)], rewards)


class Script:
    """A stand-in for ``sample_and_score`` that plays back rounds and records calls."""

    def __init__(self, rounds: list[list[str]]) -> None:
        self.rounds = rounds
        self.chunks: list[list[tuple[str, str]]] = []

    def __call__(self, examples: list[tuple[str, str]]) -> tuple[Scored, dict[str, float]]:
        index = len(self.chunks)
        self.chunks.append(examples)
        kinds = self.rounds[index]
        assert len(examples) == len(kinds)
        metrics = {
            "rollout/reward_mean": float(index),
            "perf/generate_time_s": 1.0,
            "perf/reward_time_s": 0.5,
        }
        return scored_round(index, kinds, width=3 + index), metrics


def run_make_batch(
    trainer: GRPOTrainer, monkeypatch: pytest.MonkeyPatch, rounds: list[list[str]]
) -> tuple[GRPOBatch, dict[str, float], Script]:
    script = Script(rounds)
    monkeypatch.setattr(trainer, "sample_and_score", script)
    examples = [(f"{i:06d}>", "") for i in range(WANTED * trainer.prompt_rounds())]
    batch, metrics = trainer.make_batch(examples)
    # Each round draws the next slice of the step's prompts.
    for index, chunk in enumerate(script.chunks):
        assert chunk == examples[index * WANTED : (index + 1) * WANTED]
    return batch, metrics, script


def kept_tags(batch: GRPOBatch) -> list[int]:
    return batch.rollouts.prompt_ids[::GROUP, 0].tolist()


def test_dynamic_sampling_refills_over_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = grpo_trainer(tmp_path)
    assert trainer.prompt_rounds() == 3
    assert trainer.dataset().batch_size == WANTED * 3
    rounds = [[FLAT, INFO, FLAT, INFO], [FLAT, INFO, FLAT, FLAT], [INFO, FLAT, INFO, INFO]]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 3
    # Round 1 gives groups 1 and 3, round 2 its group 0 (tag 11), round 3 its first
    # informative group (tag 20) and no more: exactly batch_size groups.
    assert kept_tags(batch) == [1, 3, 11, 20]
    assert batch.rollouts.prompt_ids.shape[0] == WANTED * GROUP
    assert batch.advantages.shape == (WANTED * GROUP,)
    # Responses of different widths are right-padded to the widest kept round.
    assert batch.rollouts.response_ids.shape[1] == 5
    assert not batch.rollouts.response_mask[:8, 3:].any()
    # No flat group is left: every kept group carries signal.
    for g in range(WANTED):
        assert batch.advantages[g * GROUP : (g + 1) * GROUP].abs().sum() > 0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5  # round 1: 2 of 4 flat
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/kept_groups"] == 4.0
    assert metrics["rollout/reward_mean"] == 0.0  # round 1's sampling metrics
    assert metrics["perf/generate_time_s"] == pytest.approx(3.0)  # summed over rounds
    assert metrics["perf/reward_time_s"] == pytest.approx(1.5)


def test_dynamic_sampling_stops_when_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    rounds = [[INFO, FLAT, INFO, FLAT], [INFO, INFO, INFO, FLAT], [INFO] * 4]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 2, "sampled another round after the batch was full"
    assert kept_tags(batch) == [0, 2, 10, 11]
    assert metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["rollout/kept_groups"] == 4.0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5


def test_dynamic_sampling_first_round_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[INFO] * 4] * 3)
    assert len(script.chunks) == 1
    assert kept_tags(batch) == [0, 1, 2, 3]
    assert metrics["rollout/zero_std_group_ratio"] == 0.0
    assert metrics["rollout/sampling_rounds"] == 1.0


def test_dynamic_sampling_partial_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only 3 informative groups in all 3 rounds: those 3 are kept, nothing flat.
    trainer = grpo_trainer(tmp_path)
    rounds = [[FLAT, FLAT, INFO, FLAT], [FLAT] * 4, [INFO, FLAT, INFO, FLAT]]
    batch, metrics, script = run_make_batch(trainer, monkeypatch, rounds)
    assert len(script.chunks) == 3
    assert kept_tags(batch) == [2, 20, 22]
    assert metrics["rollout/kept_groups"] == 3.0
    assert metrics["rollout/zero_std_group_ratio"] == 0.75


def test_dynamic_sampling_all_flat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = grpo_trainer(tmp_path)
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[FLAT] * 4] * 3)
    assert len(script.chunks) == 3
    assert batch.rollouts.prompt_ids.shape[0] == WANTED * GROUP
    assert torch.equal(batch.advantages, torch.zeros(WANTED * GROUP))
    assert metrics["rollout/kept_groups"] == 0.0
    assert metrics["rollout/sampling_rounds"] == 3.0
    assert metrics["rollout/zero_std_group_ratio"] == 1.0


def test_without_dynamic_sampling_nothing_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = grpo_trainer(tmp_path, dynamic_sampling=False)
    assert trainer.prompt_rounds() == 1
    assert trainer.dataset().batch_size == WANTED
    batch, metrics, script = run_make_batch(trainer, monkeypatch, [[FLAT, INFO, FLAT, INFO]])
    assert len(script.chunks) == 1
    assert kept_tags(batch) == [0, 1, 2, 3]
    # The flat groups stay, with zero advantages.
    assert torch.equal(batch.advantages[0:4], torch.zeros(4))
    assert torch.equal(batch.advantages[8:12], torch.zeros(4))
    assert batch.advantages[4:8].abs().sum() > 0
    assert metrics["rollout/zero_std_group_ratio"] == 0.5
    assert metrics["rollout/sampling_rounds"] == 1.0
    assert metrics["rollout/kept_groups"] == 4.0
