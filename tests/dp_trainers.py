"""A GRPO trainer whose global batch does not depend on the world size, for the
data-parallel equivalence tests: at world size 1 it rolls out each batch as two ranks
would (rank r's slice of the prompts, from rank r's generator) and concatenates the
two halves; under torchrun it is plain GRPO (the runtime slices and seeds by rank)."""

from __future__ import annotations

import dataclasses

import torch

import corun
from corun.distributed import rank_seed, shard
from trainers.lm.engine import Rollouts
from trainers.lm.grpo import GRPOBatch, GRPOTrainer

RANKS = 2


class TwoShardGRPO(GRPOTrainer):
    def rollout(self, examples: list[tuple[str, str]], ctx: corun.RolloutContext) -> corun.Batch:
        if corun.world().parallel:
            return super().rollout(examples, ctx)
        seed = self.run_config.run.seed
        parts = []
        for rank in range(RANKS):
            generator = corun.rollout_generator(rank_seed(seed, rank), ctx.index, ctx.attempt)
            rank_ctx = dataclasses.replace(ctx, generator=generator)
            parts.append(super().rollout(list(shard(examples, rank, RANKS)), rank_ctx))
        data = GRPOBatch(
            Rollouts.concat([p.data.rollouts for p in parts]),
            torch.cat([p.data.advantages for p in parts]),
        )
        # As the ranks' metrics are averaged (equal halves: the global means).
        metrics = {k: sum(p.metrics[k] for p in parts) / RANKS for k in parts[0].metrics}
        return corun.Batch(data, metrics=metrics, version=parts[0].version)
