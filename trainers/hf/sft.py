"""Supervised fine-tuning of a Hugging Face policy (registered as ``hf_sft``): the
reply to each prompt, as the chat template writes the assistant's turn, learnt by
teacher-forced cross-entropy. The loss and the update are the TinyLM SFT trainer's;
what differs is where the model, tokens and data come from, and the evaluation
(greedy replies to held-out prompts, scored by ``trainer.rewards``). Its checkpoints
warm-start ``hf_grpo`` and ``hf_ppo`` (``init_from``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from corun import Batch, Dataset, RolloutContext, SetupContext
from corun.engines.options import EngineOptions
from corun.execution.parallel import Precision
from trainers.hf import reasoning_gym
from trainers.hf.evaluation import evaluate
from trainers.hf.lora import LoraSettings, param_groups
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rewards import Rewards
from trainers.hf.rl import DEFAULT_REWARDS, TaskName, check_hf_config
from trainers.hf.state import hf_state, load_hf_state, load_model
from trainers.hf.tasks import Example, held_out_examples, training_batches
from trainers.hf.tinker import HFTrainingBackend, training_backend
from trainers.hf.training import prepare_policy
from trainers.lm.settings import PositiveInt
from trainers.lm.sft import SFTConfig, SFTTrainer, target_loss_sum
from trainers.lm.tasks import TokenBatch, teacher_forcing
from trainers.weights import to_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HFSFTConfig(SFTConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: TaskName = "word-problems"  # type: ignore[assignment]  # data.path: a JSONL instead
    model: str  # "hf:<dir>"
    system_prompt: str = ""
    # Evaluation: greedy replies of at most this many tokens, scored by these functions.
    max_new_tokens: PositiveInt = 8
    rewards: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_REWARDS))
    eval_size: PositiveInt = 256
    # How the policy trains (trainers/hf/training.py's ModelSettings): precision,
    # activation checkpointing, [trainer.lora].
    dtype: Precision = "float32"
    activation_checkpointing: bool = False
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_hf_config(self)


class HFSFTTrainer(SFTTrainer):
    Config = HFSFTConfig  # type: ignore[assignment]
    config: HFSFTConfig  # type: ignore[assignment]
    model: HFPolicy  # type: ignore[assignment]
    shards_model = True  # run.parallel = "fsdp" (trainers/hf/training.py)

    def model_groups(self, lr: float) -> list[dict[str, Any]]:
        return param_groups(self.model, self.config.lora, lr)

    def setup_model(self, ctx: SetupContext) -> PreTrainedTokenizerBase:
        """The policy (``self.model``) on the run's device, with its LoRA adapters and
        sharding (fully_shard shards it where it is); returns its tokenizer."""
        self.train_lane, self.device = ctx.lane, ctx.device
        self.model, tokenizer = load_model(self.config.model, "", "`$.trainer.model`",
                                           self.device)  # fmt: skip
        prepare_policy(self.model, self.config, self.run_config)
        return tokenizer

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        tokenizer = self.setup_model(ctx)
        self.chat = ChatFormat(tokenizer, cfg.system_prompt)
        data = self.run_config.data
        self.generated = reasoning_gym.source(data)
        scorer = self.generated.score if self.generated else None
        self.rewards = Rewards(
            cfg.rewards, "`$.trainer.rewards`", self.run_config.run.reward_timeout_s, scorer
        )
        self.setup_optimizer(ctx)
        self.held_out_examples = held_out_examples(data, cfg.eval_size, self.generated)
        self.chat.check([e.prompt for e in self.held_out_examples], "`$.data.path`")
        examples = self.held_out_examples
        self.held_out_tokens = to_device(self.encode(examples), self.device) if examples else None

    def dataset(self) -> Dataset:
        return training_batches(self.run_config.data, self.run_config.run.seed, self.generated)

    def encode(self, examples: list[Example]) -> TokenBatch:
        return teacher_forcing(
            [
                (self.chat.encode(e.prompt), self.chat.encode_reply(e.prompt, e.answer))
                for e in examples
            ],
            self.chat.pad_id,
        )

    def rollout(self, inputs: list[Example], ctx: RolloutContext) -> Batch:  # type: ignore[override]
        self.chat.check([e.prompt for e in inputs], "`$.data.path`")
        return Batch(data=self.encode(inputs))

    async def evaluate(self) -> dict[str, float]:  # type: ignore[override]
        """Masked loss and greedy reply rewards on the held-out prompts."""
        cfg, tokens = self.config, self.held_out_tokens
        if tokens is None:
            return {}

        def loss() -> float:
            with torch.no_grad():
                self.model.eval()
                return float(
                    target_loss_sum(self.model, tokens, cfg.logits_chunk) / tokens.loss_mask.sum()
                )

        value = loss() if self.train_lane is None else await self.train_lane.run(loss)
        rewards = await evaluate(
            self.model,
            self.chat,
            self.held_out_examples,
            cfg.max_new_tokens,
            self.rewards,
            self.train_lane,
        )
        return {"eval/loss": value, **rewards}

    def training_backend(self) -> HFTrainingBackend:
        return training_backend(self.model, self.chat, "local", EngineOptions(), self.run_config)

    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.model.num_params(), "model/source": str(self.model.source)}

    def state_dict(self) -> dict[str, Any]:
        return hf_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_hf_state(state, self.model, self.optimizer)
