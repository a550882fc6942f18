"""The decoupled off-policy correction: the plain clipped surrogate when the batch
is on-policy, capped importance weights when it is stale, and the same training
step as without the correction on a fresh (on-policy) GRPO batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corun import ConfigError, SetupContext, World
from tests.support.config import make_config
from tests.support.loops import Harness
from trainers import pg
from trainers.lm.grpo import GRPOTrainer
from trainers.lm.policy_gradient import rollout_logprobs
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


def test_first_mini_batch_takes_the_proximal_log_probs_from_its_own_forward(
    tmp_path: Path,
) -> None:
    """One optimizer step per batch: the weights the loss runs on are the proximal
    policy, so ``prepare`` skips the second forward pass and the loss uses its own
    log-probs, detached — the same loss and gradients as with the pass, on a batch
    made stale by an update in between. With two mini-batches the pass is made."""
    trainer_settings = {
        "kind": "grpo", "d_model": 32, "n_heads": 2, "n_layers": 1, "samples_per_prompt": 4,
        "eval_size": 8, "truncated_reward": "keep", "off_policy_correction": "decoupled",
        "lr": 0.05,
    }  # fmt: skip
    config = make_config(tmp_path / "one", trainer_settings, data={"batch_size": 4})
    harness = Harness(GRPOTrainer, config, seed=0)
    trainer = harness.trainer
    stale = harness.rollout(0)
    harness.update(harness.rollout(1))  # the weights move on: batch 0 is now stale
    prepared = trainer.prepare(stale)
    assert prepared.proximal is None and prepared.decoupled
    data, rows = prepared.data, slice(0, stale.data.rollouts.prompt_ids.shape[0])
    with torch.no_grad():
        computed, _, _ = rollout_logprobs(trainer.policy, data.rollouts, trainer.config.temperature)
    results = []
    for proximal in ("own", computed):
        trainer.policy.zero_grad()
        loss, metrics = trainer.rows_loss(data, rows, proximal)
        loss.backward()
        grads = [p.grad.clone() for p in trainer.policy.parameters() if p.grad is not None]
        results.append((loss.detach(), metrics, grads))
    (own_loss, own_metrics, own_grads), (loss, metrics, grads) = results
    assert abs(metrics["importance_weight_mean"] - 1.0) > 1e-3  # stale: weights not 1
    assert torch.allclose(own_loss, loss, atol=1e-6)
    assert abs(own_metrics["importance_weight_mean"] - metrics["importance_weight_mean"]) < 1e-6
    for own_grad, grad in zip(own_grads, grads, strict=True):
        assert torch.allclose(own_grad, grad, atol=1e-6)

    two = make_config(tmp_path / "two", trainer_settings, data={"batch_size": 4},
                      loop={"mini_batches": 2})  # fmt: skip
    assert Harness(GRPOTrainer, two, seed=0).trainer.prepare(stale).proximal is not None


def test_batch_scoped_advantages_are_refused_under_torchrun_at_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any rollout (set-up), not at the first batch: each rank would normalise
    by its own shard."""
    monkeypatch.setattr(pg, "world", lambda: World(0, 2))
    config = make_config(tmp_path, {"kind": "grpo", "d_model": 32, "n_heads": 2,
                                    "n_layers": 1, "adv_scope": "batch"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"`\$\.trainer\.adv_scope` = \"batch\""):
        GRPOTrainer(config).setup(SetupContext(config))
