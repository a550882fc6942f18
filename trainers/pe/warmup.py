"""The prompt enhancer's supervised warm-up (registered as ``pe_warmup``): the text
policy learns the true rewrites of user prompts in plain words only ("red disc top
left" → the flow model's three condition tokens), so RL starts from a policy that
knows the format and the plain names but none of the synonyms. The flow model is
only used by evaluation; it is not trained."""

from __future__ import annotations

import torch
from torch import Tensor

from corun import Batch, Part, RolloutContext, shared_count
from trainers.diffusion.sampling import mean_over
from trainers.pe.base import PEBase, PEBaseConfig
from trainers.pe.prompts import FLOW_BASE, UserBatch
from trainers.pe.rewriter import rewrite_logprobs
from trainers.weights import to_device


class PEWarmupConfig(PEBaseConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class PEWarmupTrainer(PEBase[PEWarmupConfig]):
    Config = PEWarmupConfig
    plain_prompts = True
    data_parallel = True  # the loss is a mean over every rank's rewrite tokens

    def rollout(self, inputs: UserBatch, ctx: RolloutContext) -> Batch:
        """The prompts and their true rewrites: nothing is generated."""
        return Batch(inputs)

    def prepare(self, batch: Batch) -> UserBatch:
        """The batch (built on the CPU) to the policy's device, once."""
        return to_device(batch.data, self.device)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        """Cross-entropy of the true rewrites."""
        users: UserBatch = batch.data
        rows = part.mini_rows(len(users))
        self.policy.train()
        sequences = torch.cat([users.prompt_ids[rows], users.targets[rows] + FLOW_BASE], dim=1)
        return -mean_over(rewrite_logprobs(self.policy, sequences, 1.0), shared_count), {}


__all__ = ["PEWarmupConfig", "PEWarmupTrainer"]
