"""The warm start of ``hf_agentic`` (registered as ``hf_agentic_sft``): supervised
learning on demonstrations of the chat task (``trainer.task``, its settings in
``[trainer.environment]`` as for ``hf_agentic``) — for the calculator: ask, call the
calculator, read its result, answer; for a SkyRL-Gym GSM8K env: the question, then
"#### <answer>" — with the loss on the assistant's tokens only.

A demonstration is laid out exactly as the episode runner lays out an episode
(corun/agents/chat_runner.py's ``teacher_episode``): the first messages rendered by
the model's chat template with the tools, each assistant reply as the template writes
it through its stop token (the targets), the tool result as the template's
continuation after the reply (context, never a target). The update is the SFT
trainer's; the evaluation is the RL trainer's (greedy episodes on held-out problems).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from corun import Batch, RolloutContext, SetupContext
from corun.agents.chat_runner import teacher_episode
from corun.contract.episodes import Episode
from corun.execution.parallel import Precision
from trainers.agentic.calculator import EnvSettings
from trainers.hf.agentic import TaskName, chat_task, check_turn_tokens, evaluate_chat_agent
from trainers.hf.chat_tasks import has_demonstrations, task_settings
from trainers.hf.lora import LoraSettings
from trainers.hf.rl import chat_template, check_hf_config, max_len
from trainers.hf.sft import HFSFTTrainer
from trainers.lm.settings import PositiveInt
from trainers.lm.sft import SFTConfig
from trainers.lm.tasks import TokenBatch


class HFAgenticSFTConfig(SFTConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: TaskName = "calculator"  # type: ignore[assignment]
    environment: dict[str, Any] = msgspec.field(default_factory=dict)
    model: str  # "hf:<dir>", or "tiny-llama"
    system_prompt: str = ""
    # Distinct demonstration problems, cycled in shuffled batches ("a few
    # demonstrations"); 0: a fresh set of problems in every batch.
    demonstrations: Annotated[int, msgspec.Meta(ge=0)] = 64
    # Evaluation: greedy episodes of turns of at most this many tokens, within env's
    # limits (its latency is 0).
    max_new_tokens: PositiveInt = 96
    env: EnvSettings = EnvSettings()
    eval_size: PositiveInt = 256
    # How the policy trains (trainers/hf/training.py's ModelSettings): precision,
    # activation checkpointing, [trainer.lora].
    dtype: Precision = "float32"
    activation_checkpointing: bool = False
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_hf_config(self)
        check_turn_tokens(self)
        task_settings(self.task, self.environment)
        if not has_demonstrations(self.task):
            raise ValueError(f"`$.task`: the {self.task!r} task has no demonstrations to learn")


def episode_tokens(episodes: list[Episode], pad_id: int) -> TokenBatch:
    """Episodes as teacher-forcing rows, right-padded (every row starts at position 0,
    as its prompt does in a rollout); the loss covers the policy's tokens only."""
    rows = [(e.prompt_ids + e.ids, [False] * len(e.prompt_ids) + e.trained) for e in episodes]
    length = max(len(ids) for ids, _ in rows) - 1

    def padded(values: list[Any], fill: Any) -> list[Any]:
        return values + [fill] * (length - len(values))

    return TokenBatch(
        torch.tensor([padded(ids[:-1], pad_id) for ids, _ in rows]),
        torch.tensor([padded(ids[1:], pad_id) for ids, _ in rows]),
        torch.tensor([padded(trained[1:], False) for _, trained in rows]),
    )


class HFAgenticSFTTrainer(HFSFTTrainer):
    """The HF SFT trainer's update and state on tool-use demonstrations."""

    Config = HFAgenticSFTConfig  # type: ignore[assignment]
    config: HFAgenticSFTConfig  # type: ignore[assignment]

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        tokenizer = self.setup_model(ctx)
        self.template = chat_template(self.model, tokenizer, cfg)
        self.setup_optimizer(ctx)
        self.chat_task = chat_task(cfg, self.run_config.run.seed)
        self.eval_problems = self.chat_task.eval_tasks(cfg.eval_size)

    def dataset(self) -> Any:
        return self.chat_task.demonstrations(
            self.config.demonstrations, self.run_config.data.batch_size
        )

    def rollout(self, problems: list[Any], ctx: RolloutContext) -> Batch:  # type: ignore[override]
        task = self.chat_task
        episodes = [teacher_episode(self.template, task.demonstration(p), task.tools)
                    for p in problems]  # fmt: skip
        return Batch(data=episode_tokens(episodes, self.template.pad_id))

    async def evaluate(self) -> dict[str, float]:  # type: ignore[override]
        cfg = self.config
        return await evaluate_chat_agent(
            self.model, self.template, self.eval_problems, cfg.env, cfg.max_new_tokens,
            max_len(self.model), self.train_lane,
            self.chat_task.make_env, self.chat_task.success,
        )  # fmt: skip
