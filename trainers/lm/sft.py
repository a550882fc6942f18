"""Supervised fine-tuning of TinyLM on a synthetic task or a JSONL file of (prompt, answer).

The simplest trainer on the loop template: "rollout" only tokenises the batch and the
loss is teacher-forced cross-entropy on the answer tokens (a token mean over the
whole batch, in ``micro_batches`` pieces). Its checkpoints warm-start the RL trainers
through :func:`load_policy`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch
import torch.nn.functional as F

from corun import (
    Batch,
    Dataset,
    Part,
    RolloutContext,
    SetupContext,
    ShuffledBatches,
    Trainer,
    read_jsonl,
    shared_count,
)
from trainers.lm.policy import (
    LOGITS_CHUNK,
    CausalPolicy,
    HeldOutEval,
    build_policy,
    load_policy,
    load_policy_state,
    policy_state,
    sharded,
    target_logprobs,
    with_checkpointing,
)
from trainers.lm.settings import LMTrainerConfig, NonNegativeFloat, PositiveInt
from trainers.lm.tasks import (
    CHARS,
    MAX_LEN,
    TASKS,
    TaskData,
    TokenBatch,
    encode_examples,
    unknown_chars,
)
from trainers.weights import to_device

__all__ = ["SFTConfig", "SFTTrainer", "load_policy"]


class SFTConfig(LMTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer]`` of an SFT run: the task, the TinyLM shape and the optimizer."""

    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    # Max global gradient norm; 0 turns clipping off (the norm is still reported).
    grad_clip: NonNegativeFloat = 1.0
    # Memory: each update's batch is backpropagated in this many row chunks.
    micro_batches: PositiveInt = 1
    # Held-out prompts scored by every evaluation.
    eval_size: PositiveInt = 512


class SFTRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of an SFT data file; checked while decoding, so errors name ``file:line``."""

    prompt: Annotated[str, msgspec.Meta(min_length=1)]
    answer: str

    def __post_init__(self) -> None:
        bad = unknown_chars(self.prompt + self.answer)
        if bad:
            raise ValueError(f"characters {bad!r} are not in the vocabulary {CHARS!r}")
        if len(self.prompt) + len(self.answer) + 1 > MAX_LEN:
            raise ValueError(f"prompt + answer + EOS exceeds {MAX_LEN} tokens")


class SFTTrainer(Trainer[SFTConfig]):
    Config = SFTConfig
    data_parallel = True
    shards_model = True  # run.parallel = "fsdp"

    def setup(self, ctx: SetupContext) -> None:
        # The runtime has seeded the global RNGs with run.seed: the model init draws from them.
        cfg = self.config
        self.task = TASKS[cfg.task]
        # On the run's device before sharding and the optimizer.
        self.device = ctx.device
        model = build_policy(cfg.d_model, cfg.n_layers, cfg.n_heads).to(self.device)
        model = with_checkpointing(model, cfg.activation_checkpointing)
        self.model = sharded(model, ctx.config.run.parallel)
        self.setup_optimizer(ctx)
        # Built once: the held-out set is fixed, and building it draws no global randomness.
        self.held_out = HeldOutEval(self.task, cfg.eval_size, self.device)
        self.eval_tokens = to_device(encode_examples(self.held_out.examples), self.device)

    def setup_optimizer(self, ctx: SetupContext) -> None:
        cfg = self.config
        groups = self.model_groups(cfg.lr)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip)

    def model_groups(self, lr: float) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: the model's trained parameters at ``lr``
        here; LoRA's adapters at rates of their own (trainers/hf/lora.py)."""
        return [{"params": [p for p in self.model.parameters() if p.requires_grad]}]

    def dataset(self) -> Dataset:
        data, seed = self.run_config.data, self.run_config.run.seed
        if data.path:
            records = read_jsonl(data.path, SFTRecord)
            examples = [(r.prompt, r.answer) for r in records]
            return ShuffledBatches(examples, data.batch_size, seed, data.shuffle)
        return TaskData(TASKS[self.config.task], data.batch_size, seed)

    def rollout(self, inputs: list[tuple[str, str]], ctx: RolloutContext) -> Batch:
        """SFT's build phase: tokenise the examples; nothing is generated."""
        return Batch(data=encode_examples(inputs))

    def prepare(self, batch: Batch) -> TokenBatch:
        """The tokenised batch (built on the CPU) to the model's device, once."""
        return to_device(batch.data, self.device)

    def micro_batches(self, batch: Batch) -> int:
        return self.config.micro_batches

    def row_tokens(self, batch: Batch) -> list[int]:
        tokens: TokenBatch = batch.data
        return tokens.lengths()

    def loss(self, batch: Batch, part: Part) -> tuple[torch.Tensor, dict[str, float]]:
        self.model.train()
        return token_mean_loss(self.model, batch.data, part, self.config.logits_chunk), {}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy exact match, mean reward and masked loss on the held-out set."""
        cfg = self.config
        self.model.eval()
        tokens = self.eval_tokens
        loss = target_loss_sum(self.model, tokens, cfg.logits_chunk) / tokens.loss_mask.sum()
        return {"eval/loss": float(loss), **self.held_out(self.model)}

    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.model.num_params()}

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.model, self.optimizer, self.config.task)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.model, self.optimizer, self.config.task)


def token_mean_loss(
    model: CausalPolicy, tokens: TokenBatch, part: Part, chunk_logits: int = LOGITS_CHUNK
) -> torch.Tensor:
    """``part``'s share of its mini-batch's teacher-forced token mean: divided by the
    whole mini-batch's target tokens (under torchrun every rank's: shared_count), so
    the update is the same however the mini-batch is split (``micro_batches``, or the
    token budget's chunks, each cut to its longest row)."""
    num_tokens = shared_count(tokens.loss_mask[part.mini_rows(len(tokens))].sum())
    chunk = tokens.rows(part.rows(len(tokens)))
    if part.split:
        chunk = chunk.trimmed()
    return target_loss_sum(model, chunk, chunk_logits) / num_tokens


def target_loss_sum(model: CausalPolicy, tokens: TokenBatch, chunk: int) -> torch.Tensor:
    """:func:`masked_loss_sum` of ``model``'s logits, a chunk of ``chunk`` logits at a
    time (trainer.logits_chunk): the whole (rows x length x vocabulary) never exists."""
    logp = target_logprobs(model, model.hidden(tokens.inputs), tokens.targets, chunk)
    return -(logp * tokens.loss_mask).sum()


def masked_loss_sum(logits: torch.Tensor, tokens: TokenBatch) -> torch.Tensor:
    """Summed cross-entropy over the targets in ``tokens.loss_mask`` (answer + EOS)."""
    losses = F.cross_entropy(logits.flatten(0, 1), tokens.targets.flatten(), reduction="none")
    return (losses * tokens.loss_mask.flatten()).sum()
