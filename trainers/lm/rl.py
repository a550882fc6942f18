"""TinyLM policy-gradient trainers: a TinyLM policy on local rollout engines (the base
of the single-turn and the agentic trainers), and what GRPO and PPO share on
single-turn text tasks (trainers/lm/tasks.py): the task's data and rewards, sampling
and scoring a batch of prompts, and the held-out evaluation. The update is
trainers/lm/policy_gradient.py's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from msgspec.structs import asdict
from torch import Tensor

from corun import Batch, Dataset, RolloutContext, SetupContext
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.model import TinyLM
from trainers.lm.policy import (
    HeldOutEval,
    build_policy,
    load_policy,
    load_policy_state,
    policy_from,
    policy_state,
    sharded,
    with_checkpointing,
)
from trainers.lm.policy_gradient import C, PolicyGradientTrainer, Scored
from trainers.lm.tasks import TASKS, Task, TaskData, decode_responses, encode_prompts
from trainers.weights import (
    Replicas,
    ReplicatedRollouts,
    gathered_state,
    to_device,
    whole_copy,
)


class TinyLMPolicyGradient(ReplicatedRollouts, PolicyGradientTrainer[C]):
    """A TinyLM policy generating on local engines: the train thread's, updated in place
    at each sync, and one replica per rollout worker thread (concurrency > 1)."""

    policy: TinyLM
    replicas: Replicas[LocalEngine]
    engine_source: TinyLM | None = None

    # Under torchrun the policy may shard (run.parallel = "fsdp"); its engine samples
    # from a whole copy, and a sync gathers the shards into it.
    shards_model = True

    def setup(self, ctx: SetupContext) -> None:
        self.build(ctx)
        source, self.engine_source = self.engine_source or self.policy, None
        self.replicas = Replicas(
            LocalEngine(source), self._engine_replica, LocalEngine.update_weights,
            initial=self.rollout_weights(), ctx=ctx,
        )  # fmt: skip
        self.engine = self.replicas.home

    def trained_policy(self, policy: TinyLM) -> TinyLM:
        self.engine_source = whole_copy(policy)
        policy = with_checkpointing(policy, self.config.activation_checkpointing)
        return sharded(policy, self.run_config.run.parallel)

    def initial_policy(self) -> TinyLM:
        raise NotImplementedError

    def _engine_replica(self, state: dict[str, Tensor], version: int) -> LocalEngine:
        saved = {"model_config": asdict(self.policy.config), "model": state}
        engine = LocalEngine(load_policy(saved, self.device))
        engine.version = version
        return engine

    # Rollout workers in other processes (corun/scale/ray_workers.py): what a publish sends,
    # and where a worker's trainer puts it (its engine, updated in place).
    def rollout_weights(self) -> dict[str, Tensor]:
        """The trained weights; when sharded, gathered whole (every rank together)."""
        return gathered_state(self.policy)

    def load_rollout_weights(self, state: dict[str, Tensor], version: int) -> None:
        self.replicas.sync(state, version)

    def scheduled_rollout_weights(self) -> dict[int, dict[str, Tensor]]:
        """The versions kept for the fixed schedule (restored with a checkpoint)."""
        return {int(version): state for version, state in self.replicas.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        extra = self.modules_state()
        return policy_state(self.policy, self.optimizer, self.config.task,
                            self.extra_modules, extra=extra)  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.policy, self.optimizer, self.config.task,
                          self.extra_modules)  # fmt: skip
        self.load_modules_state(state)


class LMPolicyTrainer(TinyLMPolicyGradient[C]):
    """Single-turn prompts → responses."""

    def setup(self, ctx: SetupContext) -> None:
        super().setup(ctx)
        self.task = TASKS[self.config.task]
        self.held_out = HeldOutEval(self.task, self.config.eval_size, self.device)
        self.max_new_tokens = self.config.max_new_tokens or self.task.max_answer_len + 1

    def initial_policy(self) -> TinyLM:
        """The policy to start from: the warm start's, or a fresh one."""
        cfg = self.config
        if cfg.init_from:
            return policy_from(cfg.init_from)
        return build_policy(cfg.d_model, cfg.n_layers, cfg.n_heads)

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
        # The rollouts are on the engine's device already; the rewards join them there.
        return Scored(rollouts, prompts, to_device(rewards, self.device)), metrics

    def make_batch(
        self, examples: list[tuple[str, str]], ctx: RolloutContext
    ) -> tuple[Any, dict[str, float]]:
        """A step's training data: one scored sample of the prompts (GRPO's dynamic
        sampling draws more)."""
        scored, metrics = self.sample_and_score(examples, ctx)
        return self.algorithm.training_data(scored), metrics

    def evaluate(self) -> dict[str, float]:
        return self.held_out(self.policy)


def task_rewards(
    task: Task, examples: list[tuple[str, str]], rollouts: Rollouts, n: int,
    truncated_reward: str = "keep",
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """Each of the ``n`` responses per example scored by the task (a response cut at
    the length cap earns 0 when ``truncated_reward`` is "zero"), and batch metrics.
    Scored from decoded text: on the CPU, wherever the rollouts are."""
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
