"""PPO on TinyLM: a value head on the policy's hidden states, GAE, and a clipped
value loss. Sampling, the clipped policy surrogate, mini-batch updates, sync and
evaluation are the shared LM policy-gradient trainer's.

The reward arrives on the last response token; GAE spreads it back with
``gamma``/``lam`` against the value head's estimates, computed once per batch with
the weights as they were before this batch's updates ("old values").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import torch
from torch import Tensor, nn

from corun import Rows, shared_mean_std
from trainers.lm.engine import Rollouts
from trainers.lm.policy import CausalPolicy, rollout_hidden
from trainers.lm.policy_gradient import (
    PolicyGradientAlgorithm,
    PolicyLoss,
    RLConfig,
    Scored,
)
from trainers.lm.rl import LMPolicyTrainer
from trainers.lm.settings import NonNegativeFloat
from trainers.pg import clipped_value_loss, gae

Unit = Annotated[float, msgspec.Meta(ge=0, le=1)]


class PPOConfig(RLConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=1)] = 4
    gamma: Unit = 1.0
    lam: Unit = 0.95
    value_clip: NonNegativeFloat = 0.2
    vf_coef: NonNegativeFloat = 0.5
    # Normalise advantages over the batch's tokens (zero mean, unit std).
    whiten_advantages: bool = True


@dataclass
class PPOBatch:
    rollouts: Rollouts
    old_values: Tensor  # (N, T)
    advantages: Tensor  # (N, T)
    returns: Tensor  # (N, T)


class PPO(PolicyGradientAlgorithm[PPOConfig]):
    """PPO's own math, for any source of scored batches (prompts, agent episodes): the
    value head, GAE from the reward on the final trained token, the value loss."""

    def modules(self, policy: CausalPolicy) -> dict[str, nn.Module]:
        self.value_head = nn.Linear(policy.hidden_size, 1)
        return {"value_head": self.value_head}

    def training_data(self, scored: Scored) -> Scored:
        return scored  # GAE needs the values of the weights it is trained from: prepare

    @torch.no_grad()
    def prepare(self, scored: Scored, policy: CausalPolicy) -> PPOBatch:
        rollouts, cfg = scored.rollouts, self.config
        hidden = rollout_hidden(policy, rollouts)
        mask = rollouts.response_mask
        old_values = self.value_head(hidden).squeeze(-1) * mask
        # Each response's final token (its last trained one: a multi-turn transcript has
        # untrained observation tokens between the turns).
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask, positions, -1).amax(dim=1)
        token_rewards = torch.zeros_like(old_values)
        token_rewards[torch.arange(len(last), device=last.device), last] = scored.rewards
        advantages, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            # Over the whole batch's tokens: every rank's shard, under torchrun.
            mean, std = shared_mean_std(advantages[mask])
            advantages = ((advantages - mean) / (std + 1e-6)) * mask
        return PPOBatch(rollouts, old_values, advantages, returns)

    def rows_loss(
        self, data: PPOBatch, rows: Rows, policy_loss: PolicyLoss
    ) -> tuple[Tensor, dict[str, float]]:
        clipped, metrics, hidden = policy_loss(data.rollouts, rows, data.advantages[rows])
        values = self.value_head(hidden).squeeze(-1)
        value_loss = policy_loss.aggregate(
            clipped_value_loss(
                values, data.old_values[rows], data.returns[rows], self.config.value_clip
            ),
            data.rollouts.response_mask[rows],
            "token-mean",
        )
        metrics["value_loss"] = float(value_loss.detach())
        metrics["policy_loss"] = float(clipped.detach())
        return clipped + self.config.vf_coef * value_loss, metrics


class PPOTrainer(LMPolicyTrainer[PPOConfig]):
    Config = PPOConfig
    Algorithm = PPO
    data_parallel = True  # losses use shared_count, whitening shared_mean_std
