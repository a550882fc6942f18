"""Trainers whose global batch does not depend on the world size, for the
data-parallel equivalence tests: at world size 1 each rolls out a batch as two ranks
would (rank r's slice of the inputs, from rank r's generator) and concatenates the two
halves (:func:`merge`); under torchrun it is the plain trainer (the runtime slices and
seeds by rank)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

import corun
from corun.execution.distributed import rank_seed, shard
from trainers.agentic.rl import AgenticGRPOTrainer, AgenticPPOTrainer
from trainers.diffusion.flow_rl import ImageGroups
from trainers.diffusion.grpo import FlowGRPOTrainer
from trainers.diffusion.pretrain import FlowPretrainTrainer
from trainers.diffusion.sampling import Trajectory
from trainers.hf.rl import HFGRPOTrainer, HFPPOTrainer
from trainers.lm.engine import Rollouts
from trainers.lm.grpo import GRPOTrainer
from trainers.lm.ppo import PPOTrainer
from trainers.lm.sft import SFTTrainer
from trainers.lm.tasks import PAD, TokenBatch
from trainers.pe.rl import PromptEnhancerTrainer
from trainers.pe.warmup import PEWarmupTrainer
from trainers.unified import UnifiedPretrainTrainer, UnifiedTrainer

RANKS = 2
# Fields every rank's part holds the same value of (a sampling schedule, the trained
# steps): kept once, not concatenated.
SHARED_FIELDS = {Trajectory: {"timesteps", "sigmas", "cfg_scale"}, ImageGroups: {"steps"}}


def merge(parts: list[Any]) -> Any:
    """The ranks' batch data as one batch: rollouts concatenated (padded to the longest),
    tensors and lists concatenated, dataclasses and named tuples field by field (a
    field in SHARED_FIELDS kept once)."""
    first = parts[0]
    if isinstance(first, Rollouts) and first.prompt_mask is not None:
        width = max(p.prompt_ids.shape[1] for p in parts)
        masks = [_left_pad(p.prompt_mask, width) for p in parts]  # type: ignore[arg-type]
        ids = [_left_pad(p.prompt_ids, width) for p in parts]
        plain = [
            dataclasses.replace(p, prompt_ids=i, prompt_mask=None)
            for p, i in zip(parts, ids, strict=True)
        ]
        return dataclasses.replace(Rollouts.concat(plain), prompt_mask=torch.cat(masks))
    if isinstance(first, Rollouts):
        return Rollouts.concat(parts)
    if isinstance(first, TokenBatch):  # each part right-padded to its own longest row
        width = max(p.inputs.shape[1] for p in parts)
        return TokenBatch(
            *(
                torch.cat([_right_pad(getattr(p, name), width, fill) for p in parts])
                for name, fill in (("inputs", PAD), ("targets", PAD), ("loss_mask", False))
            )
        )
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if first is None:
        return None
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a NamedTuple
        return type(first)(*(merge(list(values)) for values in zip(*parts, strict=True)))
    if dataclasses.is_dataclass(first):
        shared = SHARED_FIELDS.get(type(first), set())
        return type(first)(**{
            f.name: _same(f.name, values) if f.name in shared else merge(values)
            for f in dataclasses.fields(first)
            for values in [[getattr(p, f.name) for p in parts]]
        })  # fmt: skip
    raise TypeError(f"cannot merge {type(first).__name__}")


def _same(name: str, values: list[Any]) -> Any:
    for value in values[1:]:
        same = (
            torch.equal(value, values[0]) if isinstance(value, torch.Tensor) else value == values[0]
        )
        assert same, f"{name} differs between the ranks' parts"
    return values[0]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left padding under a prompt mask: the pads' value is never attended to."""
    return torch.nn.functional.pad(t, (width - t.shape[1], 0))


def _right_pad(t: torch.Tensor, width: int, fill: Any) -> torch.Tensor:
    """Right padding of teacher-forcing rows: masked out of the loss, and causal
    attention never lets a real token see it."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)


def _merged(parts: list[corun.Batch]) -> corun.Batch:
    # As the ranks' metrics are averaged (equal halves: the global means).
    metrics = {k: sum(p.metrics[k] for p in parts) / RANKS for k in parts[0].metrics}
    return corun.Batch(merge([p.data for p in parts]), metrics=metrics, version=parts[0].version)


def _shards(trainer: Any, inputs: list[Any], ctx: corun.RolloutContext) -> Any:
    """Each rank's inputs and rollout context, as the runtime would give them."""
    seed = trainer.run_config.run.seed
    for rank in range(RANKS):
        generator = corun.rollout_generator(rank_seed(seed, rank), ctx.index, ctx.attempt)
        part = shard(inputs, rank, RANKS)
        yield (
            list(part) if isinstance(part, Sequence) else part,
            dataclasses.replace(ctx, generator=generator),
        )


class TwoShards:
    """Mixed in before a trainer with a plain ``rollout``."""

    def rollout(self, inputs: list[Any], ctx: corun.RolloutContext) -> corun.Batch:
        if corun.world().parallel:
            return super().rollout(inputs, ctx)  # type: ignore[misc,no-any-return]
        rollout = super().rollout  # type: ignore[misc]
        return _merged([rollout(part, part_ctx) for part, part_ctx in _shards(self, inputs, ctx)])


class TwoShardsAsync:
    """Mixed in before a trainer with an ``async def rollout``."""

    async def rollout(self, inputs: list[Any], ctx: corun.RolloutContext) -> corun.Batch:
        if corun.world().parallel:
            return await super().rollout(inputs, ctx)  # type: ignore[misc,no-any-return]
        rollout = super().rollout  # type: ignore[misc]
        return _merged(
            [await rollout(part, part_ctx) for part, part_ctx in _shards(self, inputs, ctx)]
        )


class TwoShardGRPO(TwoShards, GRPOTrainer):
    pass


class TwoShardPPO(TwoShards, PPOTrainer):
    pass


class TwoShardAgentic(TwoShardsAsync, AgenticGRPOTrainer):
    pass


class TwoShardAgenticPPO(TwoShardsAsync, AgenticPPOTrainer):
    pass


class UnshardedSFT(SFTTrainer):
    """A data-parallel trainer whose model is not sharded (a user's, say)."""

    shards_model = False


class TwoShardHFGRPO(TwoShardsAsync, HFGRPOTrainer):
    pass


class TwoShardHFPPO(TwoShardsAsync, HFPPOTrainer):
    pass


class TwoShardFlowPretrain(TwoShards, FlowPretrainTrainer):
    pass


class TwoShardFlowGRPO(TwoShards, FlowGRPOTrainer):
    pass


class TwoShardPEWarmup(TwoShards, PEWarmupTrainer):
    pass


class TwoShardPE(TwoShards, PromptEnhancerTrainer):  # type: ignore[misc]
    """Prompt-enhancer RL in float64 (the default dtype from set-up on: models, noise,
    sampling); why float64: tests/test_distributed.py."""

    def setup(self, ctx: corun.SetupContext) -> None:
        torch.set_default_dtype(torch.float64)
        super().setup(ctx)


class TwoShardUnifiedPretrain(TwoShards, UnifiedPretrainTrainer):
    pass


class TwoShardUnified(TwoShards, UnifiedTrainer):
    pass
