"""GRPO and PPO over multi-turn tool-use episodes (registered as ``agentic`` and
``agentic_ppo``).

What differs from the single-turn LM trainers lives here: the policy's vocabulary and
length (the calculator task's), the dataset (problems), an ``async def`` rollout that
runs a group of ``samples_per_prompt`` episodes per problem through their
environments (corun/agents/runner.py) and scores them by their rewards, and an
evaluation that runs greedy episodes on held-out problems. The algorithms' own
pieces — group advantages, GAE, the clipped (and decoupled) policy loss over the
policy's tokens only — are GRPO's and PPO's, unchanged.

An episode whose environment failed or timed out is not trained on (its tokens are
masked out) and, under GRPO, takes its group's mean reward, so it moves nobody's
advantage; the failures are counted (``rollout/env_failures``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import torch
from torch import Tensor

from corun import Batch, ConfigError, Lane, RolloutContext, SetupContext, world
from corun.agents.runner import Generated
from corun.contract.episodes import Environment, Episode, EpisodeInbox
from corun.engines.decode import left_pad
from trainers.agentic import calculator
from trainers.agentic.calculator import EnvSettings, Problem, Problems
from trainers.agentic.policy import (
    build_agent,
    calculator_env,
    episode_metrics,
    evaluate_agent,
    run_agent,
)
from trainers.agentic.serving import CalculatorPolicy
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.grpo import GRPO, GRPOConfig
from trainers.lm.model import TinyLM
from trainers.lm.policy import policy_from
from trainers.lm.policy_gradient import Scored
from trainers.lm.ppo import PPO, PPOConfig
from trainers.lm.rl import TinyLMPolicyGradient
from trainers.lm.settings import PositiveInt, with_settings
from trainers.pg import fill_failed

# Where episodes come from: the trainer's own environments, or submitted from outside
# (a host's agents through corun.training's session, or the endpoint's capture).
Source = Literal["environments", "submitted"]


class AgenticSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What episodes add to GRPO's and PPO's settings (keys of [trainer] itself;
    with_settings builds the two configs)."""

    task: Literal["calculator"] = "calculator"
    env: EnvSettings = EnvSettings()  # [trainer.env]: tool latency, limits
    eval_size: PositiveInt = 256  # held-out problems per evaluation
    episodes: Source = "environments"


def check_agentic_config(config: Any) -> None:
    if getattr(config, "dynamic_sampling", False):
        raise ValueError("`$.dynamic_sampling` draws more prompts; episodes do not")


AgenticConfig = with_settings("AgenticConfig", GRPOConfig, AgenticSettings, check_agentic_config)
AgenticPPOConfig = with_settings(
    "AgenticPPOConfig", PPOConfig, AgenticSettings, check_agentic_config
)


class AgenticEpisodes(TinyLMPolicyGradient[Any]):
    """TinyLM policy-gradient training on multi-turn episodes; the algorithm is the
    subclass's (``Algorithm``)."""

    # Under torchrun each rank runs the groups of its shard of the problems (whole
    # groups: fill_failed and the advantages stay per group); environment seeds are
    # per (index, row of the shard) and only time tools, never reach the numbers.
    data_parallel = True

    def setup(self, ctx: SetupContext) -> None:
        self.inbox = submitted_inbox(ctx, self.config, self.run_config.data.batch_size)
        super().setup(ctx)
        self.eval_problems = calculator.eval_problems(self.config.eval_size)
        self.train_lane = ctx.lane

    def served_policy(self, lane: Lane) -> CalculatorPolicy:
        max_len = self.policy.config.max_len
        return CalculatorPolicy(
            self.run_config.run.name, max_len, lambda: self.replicas.local()[0], lane
        )

    def initial_policy(self) -> TinyLM:
        cfg = self.config
        return policy_from(cfg.init_from) if cfg.init_from else build_agent(cfg)

    def dataset(self) -> Problems:
        return Problems(self.run_config.data.batch_size, self.run_config.run.seed)

    def make_env(self, index: int, row: int, settings: EnvSettings) -> Environment:
        """The environment of episode ``row`` of the rollout of data ``index``."""
        return calculator_env(self.run_config.run.seed, index, row, settings)

    # ---- rollout
    async def rollout(self, problems: list[Problem], ctx: RolloutContext) -> Batch:
        cfg, n = self.config, self.config.samples_per_prompt
        tasks: list[Problem] | None = None
        if self.inbox is not None:
            episodes = await self.inbox.take(len(problems))
        else:
            tasks = [problem for problem in problems for _ in range(n)]
            envs = [self.make_env(ctx.index, row, cfg.env) for row in range(len(tasks))]
            episodes = await run_agent(ctx, envs, tasks, self._sampler(ctx), cfg.env, self.policy)
        rollouts = episode_rollouts(episodes, calculator.PAD, ctx.version or 0)
        if rollouts.prompt_mask is not None:  # left padding would move TinyLM's positions
            raise ValueError("the episodes of a batch need prompts of one length")
        rewards = torch.tensor([e.reward for e in episodes])
        prompts = [calculator.decode(e.prompt_ids) for e in episodes]
        trainable = torch.tensor([e.trainable for e in episodes])
        scored = Scored(rollouts, prompts, fill_failed(rewards, trainable, n))
        metrics = {f"rollout/{k}": v for k, v in episode_metrics(episodes, tasks).items()}
        metrics["perf/env_wait_time_s"] = sum(e.env_wait_s for e in episodes)
        return Batch(self.training_data(scored), metrics, version=rollouts.version)

    def _sampler(self, ctx: RolloutContext) -> Any:
        """The turn generator of one rollout, run on its worker's lane: the engine copy it
        starts with for every turn ("drain"), or the newest weights at each turn
        ("interrupt": later turns may carry newer versions)."""
        cfg = self.config
        engine: LocalEngine | None = None

        def generate(transcripts: Tensor, width: int) -> Generated:
            nonlocal engine
            if engine is None or cfg.inflight_at_sync == "interrupt":
                engine = self.replicas.local(ctx.version if engine is None else None)[0]
            out = engine.generate(
                transcripts, 1, width, cfg.temperature, cfg.top_p, generator=ctx.generator
            )
            return Generated(
                out.response_ids, out.logprobs, out.token_versions, out.response_mask.sum(1)
            )

        return generate

    # ---- evaluation: greedy episodes on held-out problems, no tool latency
    async def evaluate(self) -> dict[str, float]:
        return await evaluate_agent(
            self.policy, self.eval_problems, self.config.env, self.train_lane, self.make_env,
            self.device,
        )  # fmt: skip


def episode_rollouts(episodes: list[Episode], pad_id: int, version: int) -> Rollouts:
    """Episodes as one batch of token rows: prompts left-padded (``prompt_mask``; None
    when they are equally long), then everything after the prompt, right-padded — the
    policy's tokens trained; observations, fillers, padding and untrainable episodes
    masked out of the loss (observations still attended: they are context)."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    width = max(1, max(len(e.ids) for e in episodes))

    def rows(values: Any, fill: Any, dtype: torch.dtype) -> Tensor:
        return torch.tensor([[*v, *[fill] * (width - len(v))] for v in values], dtype=dtype)

    mask = rows([[t and e.trainable for t in e.trained] for e in episodes], False, torch.bool)
    versions = [v for e in episodes for v, t in zip(e.versions, e.trained, strict=True) if t]
    oldest = min(versions, default=version)
    return Rollouts(
        prompt_ids=prompt_ids,
        response_ids=rows([e.ids for e in episodes], pad_id, torch.long),
        response_mask=mask,
        logprobs=rows([e.logprobs for e in episodes], 0.0, torch.float32),
        truncated=torch.tensor([e.status != "done" for e in episodes]),
        token_versions=rows(
            [[max(v, oldest) for v in e.versions] for e in episodes], oldest, torch.long
        ),
        version=oldest,
        prompt_mask=None if bool(prompt_mask.all()) else prompt_mask,
    )


def submitted_inbox(ctx: SetupContext, config: Any, batch_size: int) -> EpisodeInbox | None:
    """The inbox a trainer takes its episodes from when ``trainer.episodes =
    "submitted"`` (None otherwise), sized for its groups; refused, naming the setting,
    under data-parallel training or when nothing can submit to the run."""
    if config.episodes != "submitted":
        return None
    if world().parallel:
        raise ConfigError(
            '`$.trainer.episodes` = "submitted": not under data-parallel training (the '
            "episodes arrive unsharded); run it with run.nproc = 1"
        )
    if ctx.inbox is None:
        raise ConfigError(
            '`$.trainer.episodes` = "submitted": nothing submits episodes to this run; '
            "embed it (corun.training) or set serve.enabled = true"
        )
    ctx.inbox.group_size = config.samples_per_prompt
    # Two steps' worth in waiting: a faster agent pool waits (backpressure) rather than
    # piling up episodes that would be stale by the time they are trained.
    ctx.inbox.capacity = 2 * batch_size * ctx.inbox.group_size
    return ctx.inbox


class AgenticGRPOTrainer(AgenticEpisodes):
    Config = AgenticConfig
    Algorithm = GRPO


class AgenticPPOTrainer(AgenticEpisodes):
    Config = AgenticPPOConfig
    Algorithm = PPO
