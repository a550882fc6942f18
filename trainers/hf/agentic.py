"""GRPO and PPO over multi-turn tool episodes with a Hugging Face chat policy
(registered as ``hf_agentic`` and ``hf_agentic_ppo``).

What differs from the single-turn HF trainers (trainers/hf/rl.py) lives here: the task
(the calculator as a chat function tool, trainers/hf/tools.py), an ``async def``
rollout that runs a group of ``samples_per_prompt`` episodes per problem through
their environments on the run's engine (corun/agents/chat_runner.py: each turn one
``generate`` over every live transcript, the environments' messages rendered by the
model's own chat template), or takes episodes that agents played through the endpoint
(``episodes = "submitted"``), and an evaluation of greedy episodes on held-out
problems. The policy, the engines, the verified weight syncs and the serving are
:class:`~trainers.hf.rl.HFRollouts`'; the algorithms are GRPO's and PPO's, unchanged.

A transcript's tokens after its prompt are one response row: the policy's sampled
ids are trained; the template's ids between turns (tool results) are attended, never
trained. Prompts of different lengths are left-padded and the position ids skip the
padding, so every token is recomputed in the context, at the positions, it was sampled
in. An episode whose environment failed or timed out is not trained on and, under
GRPO, takes its group's mean reward.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import torch

from corun import Batch, Dataset, Lane, RolloutContext, SetupContext
from corun.agents.chat import ChatTemplate
from corun.agents.chat_runner import ChatEnvironment, Generate, run_chat_episodes
from corun.contract.engine import Generation, Sampling
from corun.contract.episodes import Episode
from corun.engines import continuous
from corun.execution import parallel
from trainers.agentic.calculator import EnvSettings
from trainers.agentic.policy import episode_metrics
from trainers.agentic.rl import (
    AgenticSettings,
    check_agentic_config,
    episode_rollouts,
    submitted_inbox,
)
from trainers.hf.chat_tasks import ChatTask, task_class, task_settings
from trainers.hf.policy import HFPolicy
from trainers.hf.rl import DEFAULT_REWARDS, HFGRPOConfig, HFPPOConfig, HFRollouts
from trainers.lm.grpo import GRPO
from trainers.lm.policy_gradient import Scored
from trainers.lm.ppo import PPO
from trainers.lm.settings import with_settings
from trainers.pg import fill_failed

# The environment of episode ``row`` of the rollout of data ``index`` (-1: evaluation).
MakeEnv = Callable[[int, int, EnvSettings], ChatEnvironment]
# Whether an episode did its task (ChatTask.success).
Succeeded = Callable[[Episode], bool]
TaskName = Literal["calculator", "openenv", "skyrl-gym", "verifiers"]


class ChatTaskSettings(AgenticSettings, frozen=True, kw_only=True):
    """What an hf: chat policy's episodes add: the chat task (trainers/hf/chat_tasks.py)
    and its own settings, ``[trainer.environment]``."""

    task: TaskName = "calculator"  # type: ignore[assignment]
    environment: dict[str, Any] = msgspec.field(default_factory=dict)


def check_chat_episodes(config: Any) -> None:
    """Settings that mean nothing here: refused, naming them; the task's settings
    converted to its own struct (a bad key named)."""
    check_agentic_config(config)
    if config.rewards != DEFAULT_REWARDS:
        raise ValueError("`$.rewards`: the environment scores an episode; there is nothing to set")
    check_turn_tokens(config)
    task_settings(config.task, config.environment)


def check_turn_tokens(config: Any) -> None:
    if config.env.turn_tokens != EnvSettings().turn_tokens:
        raise ValueError(
            "`$.env.turn_tokens` is the TinyLM task's; an hf: policy's turns are "
            "`$.max_new_tokens` tokens long"
        )


def chat_task(config: Any, seed: int) -> ChatTask:
    """The run's chat task (``trainer.task``) with its settings."""
    settings = task_settings(config.task, config.environment)
    return task_class(config.task)(settings, seed, config.system_prompt)


# The HF settings (model, engine, system prompt, max_new_tokens: tokens per turn), then
# the episodes' (task, env, eval_size, episodes).
HFAgenticConfig = with_settings(
    "HFAgenticConfig", HFGRPOConfig, ChatTaskSettings, check_chat_episodes
)
HFAgenticPPOConfig = with_settings(
    "HFAgenticPPOConfig", HFPPOConfig, ChatTaskSettings, check_chat_episodes
)


class HFAgentic(HFRollouts):
    """An hf: chat policy trained on multi-turn tool episodes; the algorithm is the
    subclass's (``Algorithm``)."""

    async def setup(self, ctx: SetupContext) -> None:
        self.inbox = submitted_inbox(ctx, self.config, self.run_config.data.batch_size)
        await super().setup(ctx)
        await self.task.start(ctx)  # its server or process, ended at teardown

    def build_task(self) -> None:
        cfg = self.config
        self.template = self.chat_template()
        self.task = chat_task(cfg, self.run_config.run.seed)
        self.eval_problems = self.task.eval_tasks(cfg.eval_size)
        self.sampling = Sampling(
            cfg.max_new_tokens, cfg.temperature, cfg.top_p, self.template.stop_ids
        )

    def dataset(self) -> Dataset:
        return self.task.dataset(self.run_config.data.batch_size)

    # ---- rollout
    async def rollout(self, problems: list[Any], ctx: RolloutContext) -> Batch:
        cfg, n = self.config, self.config.samples_per_prompt
        if self.inbox is not None:
            episodes = await self.task.submitted(self.inbox, len(problems))
        else:
            tasks = [problem for problem in problems for _ in range(n)]
            envs = [self.task.make_env(ctx.index, row, cfg.env) for row in range(len(tasks))]
            episodes = await run_chat_episodes(
                ctx, envs, tasks, self.engine.generate, self.template, self.sampling,
                max_turns=cfg.env.max_turns, max_len=self.max_len,
                step_timeout_s=cfg.env.step_timeout_s,
            )  # fmt: skip
        rollouts = episode_rollouts(episodes, self.template.pad_id, ctx.version or 0)
        rewards = torch.tensor([e.reward for e in episodes])
        trainable = torch.tensor([e.trainable for e in episodes])
        prompts = [self.template.decode(e.prompt_ids) for e in episodes]
        metrics = {
            f"rollout/{k}": v for k, v in chat_episode_metrics(episodes, self.task.success).items()
        }
        metrics["rollout/partial_ratio"] = float(rollouts.spans_versions().float().mean())
        metrics["perf/env_wait_time_s"] = sum(e.env_wait_s for e in episodes)
        version = rollouts.version
        data = self.training_data(Scored(rollouts, prompts, fill_failed(rewards, trainable, n)))
        return Batch(data, metrics, version=version, weights=self.weights(version))

    # ---- evaluation: greedy episodes on held-out problems, no tool latency
    async def evaluate(self) -> dict[str, float]:
        cfg = self.config
        return await evaluate_chat_agent(
            self.policy, self.template, self.eval_problems, cfg.env, cfg.max_new_tokens,
            self.max_len, self.train_lane, self.task.make_env, self.task.success,
        )  # fmt: skip


async def evaluate_chat_agent(
    policy: HFPolicy, template: ChatTemplate, problems: Sequence[Any],
    settings: EnvSettings, max_new_tokens: int, max_len: int, lane: Lane | None,
    make_env: MakeEnv, success: Succeeded,
) -> dict[str, float]:  # fmt: skip
    """Greedy episodes of the live ``policy`` on held-out problems without tool latency
    (its cost is not the policy's), decoding on ``lane``: ``eval/success``,
    ``eval/reward``, ``eval/tool_calls_mean``, ..."""
    settings = msgspec.structs.replace(settings, latency_ms=0.0)
    envs = [make_env(-1, row, settings) for row in range(len(problems))]
    ctx = RolloutContext(-1, torch.Generator(), lane=lane, track="eval")
    greedy = Sampling(max_new_tokens, 0.0, 1.0, template.stop_ids)
    episodes = await run_chat_episodes(
        ctx, envs, problems, greedy_decode(policy, template.pad_id, ctx), template, greedy,
        max_turns=settings.max_turns, max_len=max_len, step_timeout_s=settings.step_timeout_s,
    )  # fmt: skip
    metrics = chat_episode_metrics(episodes, success)
    metrics["reward"] = metrics.pop("reward_mean")  # eval/reward: the shared name
    return {f"eval/{k}": v for k, v in metrics.items()}


def greedy_decode(policy: HFPolicy, pad_id: int, ctx: RolloutContext) -> Generate:
    """Generation by the live policy itself (no engine): greedy, on ``ctx``'s lane."""

    def whole(prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        with parallel.gathered(policy):  # decoding enters the model past its hooks
            return continuous.generate(policy, prompts, sampling, None, pad_id)

    async def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        return await ctx.compute(whole, prompts, sampling)

    return generate


def chat_episode_metrics(episodes: list[Episode], success: Succeeded) -> dict[str, float]:
    """The TinyLM agentic trainer's episode metrics (mean reward, turns, tool calls; tool
    errors, environment failures), success — the task's judgement: for the calculator,
    the episode ended with the exact answer, the only reply it scores 1 — and trained
    tokens."""
    metrics = episode_metrics(episodes, None)
    metrics["success"] = statistics.fmean(float(success(e)) for e in episodes)
    metrics["trained_tokens_mean"] = statistics.fmean(sum(e.trained) for e in episodes)
    return metrics


class HFAgenticGRPOTrainer(HFAgentic):
    Config = HFAgenticConfig
    Algorithm = GRPO


class HFAgenticPPOTrainer(HFAgentic):
    Config = HFAgenticPPOConfig
    Algorithm = PPO
