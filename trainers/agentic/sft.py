"""The agentic warm start (registered as ``agentic_sft``): supervised learning on
demonstration episodes of the calculator task — call the tool, read its answer,
answer — with the loss on the policy's own tokens only (observations are context,
never targets). Its checkpoints warm-start ``agentic``; its evaluation is the RL
trainer's (greedy episodes on held-out problems)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import torch

from corun import (
    Batch,
    Part,
    RolloutContext,
    SetupContext,
    ShuffledBatches,
    Trainer,
    TrainerConfig,
)
from trainers.agentic import calculator
from trainers.agentic.calculator import EnvSettings, Problem, Problems
from trainers.agentic.policy import build_agent, calculator_env, evaluate_agent
from trainers.lm.policy import load_policy_state, policy_state, sharded
from trainers.lm.sft import token_mean_loss
from trainers.lm.tasks import TokenBatch
from trainers.weights import to_device

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class AgenticSFTConfig(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: Literal["calculator"] = "calculator"
    d_model: PositiveInt = 128
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0
    # Distinct demonstration problems, cycled in shuffled batches ("a few
    # demonstrations"); 0: a fresh set of problems in every batch.
    demonstrations: Annotated[int, msgspec.Meta(ge=0)] = 64
    eval_size: PositiveInt = 256
    env: EnvSettings = EnvSettings()  # the evaluation's limits (its latency is 0)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"`$.d_model` ({self.d_model}) must be divisible by `$.n_heads` ({self.n_heads})"
            )


def encode_demonstrations(problems: list[Problem]) -> TokenBatch:
    """Each problem's ideal episode laid out as the runner lays out episodes (replies
    with EOS, observations at their fixed width), right-padded; the loss mask covers
    the replies only."""
    rows = []
    for problem in problems:
        ids, trained = calculator.encode(problem.prompt), [False] * calculator.PROMPT_LEN
        for reply, observation in calculator.demonstration(problem):
            reply_ids = [*calculator.encode(reply), calculator.EOS]
            ids, trained = ids + reply_ids, trained + [True] * len(reply_ids)
            if observation:
                seen = calculator.encode_observation(observation)
                ids, trained = ids + seen, trained + [False] * len(seen)
        rows.append((ids, trained))
    length = max(len(ids) for ids, _ in rows) - 1
    pad = calculator.PAD
    return TokenBatch(
        torch.tensor([ids[:-1] + [pad] * (length - len(ids) + 1) for ids, _ in rows]),
        torch.tensor([ids[1:] + [pad] * (length - len(ids) + 1) for ids, _ in rows]),
        torch.tensor([trained[1:] + [False] * (length - len(ids) + 1) for ids, trained in rows]),
    )


class AgenticSFTTrainer(Trainer[AgenticSFTConfig]):
    Config = AgenticSFTConfig
    data_parallel = True
    shards_model = True  # run.parallel = "fsdp"

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        # On the run's device before sharding and the optimizer.
        self.device = ctx.device
        self.model = sharded(build_agent(cfg).to(self.device), ctx.config.run.parallel)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip)
        self.eval_problems = calculator.eval_problems(cfg.eval_size)
        self.train_lane = ctx.lane

    def dataset(self) -> Any:
        data = self.run_config.data
        return demonstration_problems(self.config.demonstrations, data.batch_size,
                                      self.run_config.run.seed)  # fmt: skip

    def rollout(self, problems: list[Problem], ctx: RolloutContext) -> Batch:
        return Batch(encode_demonstrations(problems))

    def prepare(self, batch: Batch) -> TokenBatch:
        """The demonstrations (tokenised on the CPU) to the model's device, once."""
        return to_device(batch.data, self.device)

    def row_tokens(self, batch: Batch) -> list[int]:
        tokens: TokenBatch = batch.data
        return tokens.lengths()

    def loss(self, batch: Batch, part: Part) -> tuple[torch.Tensor, dict[str, float]]:
        self.model.train()
        return token_mean_loss(self.model, batch.data, part), {}

    async def evaluate(self) -> dict[str, float]:
        seed = self.run_config.run.seed

        def make_env(index: int, row: int, settings: EnvSettings) -> Any:
            return calculator_env(seed, index, row, settings)

        return await evaluate_agent(
            self.model, self.eval_problems, self.config.env, self.train_lane, make_env,
            self.device,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.model, self.optimizer, self.config.task)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.model, self.optimizer, self.config.task)


def demonstration_problems(demonstrations: int, batch_size: int, seed: int) -> Any:
    """The problems demonstrated: a fixed pool of ``demonstrations`` problems in
    shuffled batches, or (0) a fresh batch of problems every step."""
    if demonstrations:
        pool = Problems(demonstrations, seed).batch(0)
        return ShuffledBatches(pool, batch_size, seed, shuffle=True)
    return Problems(batch_size, seed)
