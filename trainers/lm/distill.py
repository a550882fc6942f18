"""On-policy distillation's own math, for any source of scored batches: the student
samples, a teacher scores the student's tokens, and the student is trained towards
the teacher on the states it visits itself — the per-token reverse KL,
KL(student ‖ teacher) — optionally plus ``reward_weight`` × the task reward's group
advantage (GRPO's). Two estimators (``distill_kl``):

- ``"sampled"``: each sampled token's advantage is the teacher's log-prob minus the
  student's behaviour log-prob (a one-sample estimate of the negative reverse KL: the
  form of TRL's, NeMo-RL's and the tinker-cookbook's distillation). It needs only the
  sampled tokens' log-probs from the teacher, but its
  variance grows with the distance between the two: on a state where the teacher
  finds every token unlikely, every sampled token is pushed down hard.
- ``"exact"`` (default): the teacher returns its whole log-prob row at each response
  position, and the loss adds the exact reverse KL over the vocabulary at each,
  Σ_v S(v)·(log S(v) − log T(v)), from the same forward pass as the policy loss. On
  the built-in word problems the sampled form did not lower the KL in 300 steps
  where this one did (docs/distillation.md).

The clipped policy loss, the rollout corrections and the mismatch diagnostics are the
shared ones (trainers/lm/policy_gradient.py). Where the teacher's log-probs come from
is the trainer's (trainers/hf/distill.py: an engine of the teacher's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from corun import Rows
from trainers.lm.engine import Rollouts
from trainers.lm.policy import CausalPolicy, exact_reverse_kl
from trainers.lm.policy_gradient import PolicyGradientAlgorithm, PolicyLoss, RLConfig, Scored
from trainers.lm.settings import NonNegativeFloat
from trainers.pg import group_advantages


class DistillConfig(RLConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The task reward's group advantage, weighted, beside the teacher's per-token one
    # (0: the teacher alone; above 0 needs samples_per_prompt >= 2 to form groups).
    reward_weight: NonNegativeFloat = 0.0
    # How the reverse KL is estimated (see above): "exact" needs the teacher's whole
    # log-prob rows, "sampled" its sampled tokens' log-probs only.
    distill_kl: Literal["exact", "sampled"] = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_weight > 0 and self.samples_per_prompt < 2:
            raise ValueError(
                f"`$.reward_weight` = {self.reward_weight}: the reward's advantage compares "
                "each response with its group, which needs samples_per_prompt >= 2"
            )


@dataclass
class DistillBatch:
    rollouts: Rollouts
    advantages: Tensor  # (N, T): one per response token
    teacher_rows: Tensor | None = None  # (N, T, vocab) under "exact"


class Distill(PolicyGradientAlgorithm[DistillConfig]):
    """Advantages from a teacher's log-probs of the sampled tokens
    (``Scored.teacher_logprobs``)."""

    def modules(self, policy: CausalPolicy) -> dict[str, nn.Module]:
        self.policy = policy  # its head turns the loss's hidden states into logits
        return {}

    def training_data(self, scored: Scored) -> DistillBatch:
        rollouts, cfg = scored.rollouts, self.config
        mask = rollouts.response_mask
        exact = cfg.distill_kl == "exact"
        if (scored.teacher_rows if exact else scored.teacher_logprobs) is None:
            raise ValueError(f"{cfg.distill_kl} distillation needs the teacher's log-probs")
        if exact:
            advantages = torch.zeros_like(rollouts.logprobs)
        else:
            assert scored.teacher_logprobs is not None
            advantages = (scored.teacher_logprobs - rollouts.logprobs) * mask
        if cfg.reward_weight > 0:
            by_reward = group_advantages(scored.rewards, cfg.samples_per_prompt)
            advantages = advantages + cfg.reward_weight * by_reward[:, None] * mask
        return DistillBatch(rollouts, advantages, scored.teacher_rows if exact else None)

    def rows_loss(
        self, data: DistillBatch, rows: Rows, policy_loss: PolicyLoss
    ) -> tuple[Tensor, dict[str, float]]:
        loss, metrics, hidden = policy_loss(data.rollouts, rows, data.advantages[rows])
        if data.teacher_rows is None:
            return loss, metrics
        kl = self.exact_kl(hidden, data.teacher_rows[rows])
        mask = data.rollouts.response_mask[rows]
        metrics["distill_kl"] = policy_loss.mean(kl.detach(), mask)
        return loss + policy_loss.aggregate(kl, mask, self.config.loss_agg), metrics

    def exact_kl(self, hidden: Tensor, teacher: Tensor) -> Tensor:
        """KL(student ‖ teacher) at each response position, (rows, T): the student's
        distribution is the sampled one (at the run's temperature), its logits a chunk
        of positions at a time (trainer.logits_chunk)."""
        cfg = self.config
        return exact_reverse_kl(self.policy, hidden, teacher, cfg.temperature, cfg.logits_chunk)
