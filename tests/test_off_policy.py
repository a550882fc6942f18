"""The decoupled off-policy correction: the plain clipped surrogate when the batch
is on-policy, capped importance weights when it is stale, and the same training
step as without the correction on a fresh (on-policy) GRPO batch."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import make_config
from tests.loops import Harness
from trainers.lm.grpo import GRPOTrainer
from trainers.pg import clipped_surrogate, decoupled_surrogate


def test_on_policy_equals_clipped_surrogate() -> None:
    logp = torch.tensor([[-1.0, -0.5, -2.0]])
    proximal = torch.tensor([[-1.2, -0.4, -2.0]])
    advantages = torch.tensor([[1.5]])
    plain, plain_clipped = clipped_surrogate(logp, proximal, advantages, 0.2, 0.28)
    loss, clipped, weights = decoupled_surrogate(
        logp, proximal, proximal, advantages, 0.2, 0.28, cap=2.0
    )
    assert torch.equal(weights, torch.ones_like(weights))
    assert torch.equal(loss, plain) and torch.equal(clipped, plain_clipped)


def test_stale_tokens_are_weighted_and_capped() -> None:
    logp = torch.zeros(1, 3)
    proximal = torch.zeros(1, 3)
    # Behaviour probabilities 0.9x, 0.5x and 0.1x the proximal ones.
    behaviour = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    loss, _, weights = decoupled_surrogate(
        logp, proximal, behaviour, torch.tensor([[1.0]]), 0.2, 0.2, cap=2.0
    )
    expected = torch.tensor([[1 / 0.9, 2.0, 2.0]])  # 1/0.5 = 2 and 1/0.1 = 10 -> capped at 2
    assert torch.allclose(weights, expected)
    assert torch.allclose(loss, -expected)  # ratio 1 to the proximal policy, A = 1


def test_decoupled_step_equals_plain_step_on_policy(tmp_path: Path) -> None:
    """At concurrency 1 with one update per batch, proximal == behaviour: same weights."""
    states = []
    for correction in ("none", "decoupled"):
        config = make_config(
            tmp_path / correction,
            {"kind": "grpo", "d_model": 32, "n_heads": 2, "n_layers": 1,
             "samples_per_prompt": 4, "eval_size": 8, "truncated_reward": "keep",
             "off_policy_correction": correction},
            data={"batch_size": 4},
        )  # fmt: skip
        harness = Harness(GRPOTrainer, config, seed=0)
        trainer = harness.trainer
        for step in range(2):
            metrics = harness.update(harness.rollout(step))
            trainer.sync_weights(step + 1)
        if correction == "decoupled":
            assert abs(metrics["train/importance_weight_mean"] - 1.0) < 1e-5
        states.append(trainer.policy.state_dict())
    # Not bitwise: the loss is multiplied by weights that are 1 only up to rounding.
    for key in states[0]:
        assert torch.allclose(states[0][key], states[1][key], atol=1e-6), key
