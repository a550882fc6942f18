"""What GRPO and PPO share on single-turn text tasks (trainers/lm/tasks.py): the task's
data and rewards, sampling and scoring a batch of prompts, and the held-out
evaluation. The policy-gradient machinery is trainers/lm/policy_gradient.py's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from corun import Batch, Dataset, RolloutContext
from trainers.lm.engine import Rollouts
from trainers.lm.model import TinyLM
from trainers.lm.policy import HeldOutEval, build_policy, policy_from
from trainers.lm.policy_gradient import C, PolicyGradientTrainer, Scored
from trainers.lm.tasks import TASKS, Task, TaskData, decode_responses, encode_prompts


class LMPolicyTrainer(PolicyGradientTrainer[C]):
    """Single-turn prompts → responses; an algorithm class supplies ``make_batch``."""

    def initial_policy(self) -> TinyLM:
        """The policy to start from: the warm start's, or a fresh one."""
        cfg = self.config
        if cfg.init_from:
            return policy_from(cfg.init_from)
        return build_policy(cfg.d_model, cfg.n_layers, cfg.n_heads)

    def setup_task(self) -> None:
        """The task, its held-out evaluation and the response length cap."""
        self.task = TASKS[self.config.task]
        self.held_out = HeldOutEval(self.task, self.config.eval_size)
        self.max_new_tokens = self.config.max_new_tokens or self.task.max_answer_len + 1

    def dataset(self) -> Dataset:
        batch_size = self.run_config.data.batch_size * self.prompt_rounds()
        return TaskData(self.task, batch_size, self.run_config.run.seed)

    def prompt_rounds(self) -> int:
        """Prompt batches drawn per step (dynamic sampling draws extra to refill)."""
        return 1

    # ---- rollout
    def rollout(self, examples: list[tuple[str, str]], ctx: RolloutContext) -> Batch:
        started = time.monotonic()
        data, metrics = self.make_batch(examples, ctx)
        metrics["perf/rollout_total_time_s"] = time.monotonic() - started
        return Batch(data, metrics=metrics, version=data.rollouts.version)

    def sample_and_score(
        self, examples: list[tuple[str, str]], ctx: RolloutContext
    ) -> tuple[Scored, dict[str, float]]:
        """Sample ``samples_per_prompt`` responses per prompt and score them."""
        cfg, n = self.config, self.config.samples_per_prompt
        started = time.monotonic()
        engine = self.replicas.local(ctx.version)[0]
        interrupt = cfg.inflight_at_sync == "interrupt" and engine is not self.engine
        rollouts = engine.generate(
            encode_prompts([p for p, _ in examples]), n, self.max_new_tokens, cfg.temperature,
            cfg.top_p, generator=ctx.generator,
            newer_weights=(lambda: self.replicas.latest) if interrupt else None,
        )  # fmt: skip
        generated = time.monotonic()
        rewards, reward_metrics = task_rewards(
            self.task, examples, rollouts, n, cfg.truncated_reward
        )
        prompts = [p for p, _ in examples for _ in range(n)]
        metrics = {
            **{f"rollout/{key}": value for key, value in reward_metrics.items()},
            # Responses continued by newer weights part-way (interrupt mode).
            "rollout/partial_ratio": float(rollouts.spans_versions().float().mean()),
            "perf/generate_time_s": generated - started,
            "perf/reward_time_s": time.monotonic() - generated,
        }
        return Scored(rollouts, prompts, rewards), metrics

    def make_batch(
        self, examples: list[tuple[str, str]], ctx: RolloutContext
    ) -> tuple[Any, dict[str, float]]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return self.held_out(self.policy)


def task_rewards(
    task: Task, examples: list[tuple[str, str]], rollouts: Rollouts, n: int,
    truncated_reward: str = "keep",
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """Each of the ``n`` responses per example scored by the task (a response cut at
    the length cap earns 0 when ``truncated_reward`` is "zero"), and batch metrics."""
    responses = decode_responses(rollouts.response_ids)
    rewards = torch.tensor([
        0.0 if cut and truncated_reward == "zero" else task.reward(p, a, response)
        for (p, a), response, cut in zip(
            (ex for ex in examples for _ in range(n)), responses, rollouts.truncated.tolist(),
            strict=True,
        )
    ])  # fmt: skip
    return rewards, {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response_len_mean": float(rollouts.response_mask.sum(dim=1).float().mean()),
        "truncated_ratio": float(rollouts.truncated.float().mean()),
    }
