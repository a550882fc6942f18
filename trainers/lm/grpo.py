"""GRPO on TinyLM, with the DAPO options: clip-higher, dynamic sampling with refill,
token-level loss aggregation, and a truncated-response reward policy.

Only what differs from PPO lives here: advantages are each response's reward
against its group of ``samples_per_prompt`` responses to the same prompt, and with
dynamic sampling the groups whose rewards are all equal (no learning signal) are
dropped and refilled from extra prompt batches drawn for the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from corun import ConfigError, RolloutContext, Rows, SetupContext, world
from trainers.lm.engine import Rollouts
from trainers.lm.policy_gradient import (
    PolicyGradientAlgorithm,
    PolicyLoss,
    RLConfig,
    Scored,
)
from trainers.lm.rl import LMPolicyTrainer
from trainers.lm.settings import PositiveInt
from trainers.pg import AdvantageScope, check_scope_shardable, group_advantages, zero_std_groups


class GRPOConfig(RLConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    adv_scope: AdvantageScope = "group"
    adv_std_norm: bool = True
    # Drop groups whose rewards are all equal and refill from extra prompt batches,
    # drawing at most max_sampling_rounds batches of prompts per step.
    dynamic_sampling: bool = False
    max_sampling_rounds: PositiveInt = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples_per_prompt < 2:
            raise ValueError(
                f"`$.samples_per_prompt` = {self.samples_per_prompt}: GRPO compares each "
                "response with its group, which needs at least 2 samples per prompt"
            )


@dataclass
class GRPOBatch:
    rollouts: Rollouts
    advantages: Tensor  # (N,) one per response


class GRPO(PolicyGradientAlgorithm[GRPOConfig]):
    """GRPO's own math, for any source of scored batches (prompts, agent episodes):
    each row's advantage against its group of ``samples_per_prompt``."""

    def check(self) -> None:
        check_scope_shardable(self.config.adv_scope, "adv_scope")

    def training_data(self, scored: Scored) -> GRPOBatch:
        cfg, n = self.config, self.config.samples_per_prompt
        advantages = group_advantages(scored.rewards, n, cfg.adv_scope, cfg.adv_std_norm)
        return GRPOBatch(scored.rollouts, advantages)

    def rows_loss(
        self, data: GRPOBatch, rows: Rows, policy_loss: PolicyLoss
    ) -> tuple[Tensor, dict[str, float]]:
        loss, metrics, _ = policy_loss(data.rollouts, rows, data.advantages[rows, None])
        return loss, metrics


class GRPOTrainer(LMPolicyTrainer[GRPOConfig]):
    Config = GRPOConfig
    Algorithm = GRPO
    data_parallel = True  # rows are whole groups of a prompt; the loss uses shared_count

    def setup(self, ctx: SetupContext) -> None:
        if self.config.dynamic_sampling and world().parallel:
            raise ConfigError(
                "`$.trainer.dynamic_sampling`: not under data-parallel training yet (each "
                "rank would refill its own groups); set it to false or run.nproc = 1"
            )
        super().setup(ctx)

    def prompt_rounds(self) -> int:
        return self.config.max_sampling_rounds if self.config.dynamic_sampling else 1

    def make_batch(
        self, examples: list[tuple[str, str]], ctx: RolloutContext
    ) -> tuple[GRPOBatch, dict[str, float]]:
        cfg, n = self.config, self.config.samples_per_prompt
        wanted = self.run_config.data.batch_size
        kept: list[Scored] = []
        num_kept = 0
        metrics: dict[str, float] = {}
        for round_index in range(self.prompt_rounds()):
            chunk = examples[round_index * wanted : (round_index + 1) * wanted]
            scored, round_metrics = self.sample_and_score(chunk, ctx)
            no_signal = zero_std_groups(scored.rewards, n)
            if round_index == 0:  # what sampling gives, before any filtering
                metrics = round_metrics | {
                    "rollout/zero_std_group_ratio": float(no_signal.float().mean())
                }
            else:
                for key in ("perf/generate_time_s", "perf/reward_time_s"):
                    metrics[key] += round_metrics[key]
            if not cfg.dynamic_sampling:
                kept, num_kept = [scored], wanted
                break
            groups = torch.nonzero(~no_signal).flatten()[: wanted - num_kept]
            if groups.numel():
                kept.append(select_groups(scored, groups, n))
                num_kept += groups.numel()
            if num_kept == wanted:
                break
        if not kept:  # every group of every round was flat: train on zero advantages
            kept = [scored]
        metrics["rollout/sampling_rounds"] = float(round_index + 1)
        metrics["rollout/kept_groups"] = float(num_kept)
        rollouts = Rollouts.concat([s.rollouts for s in kept])
        rewards = torch.cat([s.rewards for s in kept])
        prompts = [prompt for s in kept for prompt in s.prompts]
        return self.algorithm.training_data(Scored(rollouts, prompts, rewards)), metrics


def select_groups(scored: Scored, groups: Tensor, group_size: int) -> Scored:
    """The rows of the given groups (prompt-major layout), in order."""
    rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()
    return Scored(
        scored.rollouts.select(rows),
        [scored.prompts[i] for i in rows.tolist()],
        scored.rewards[rows],
    )
