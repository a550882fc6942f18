"""What the agentic trainers share: the policy (a TinyLM over the calculator's
vocabulary), running episodes with it, the greedy evaluation on held-out problems,
and the episode metrics."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import torch
from torch import Tensor

from corun import Lane, RolloutContext, stable_seed
from corun.agents.runner import Codec, Generated, TurnFn, run_episodes
from corun.contract.episodes import Environment, Episode
from corun.execution import parallel
from trainers.agentic import calculator
from trainers.agentic.calculator import CalculatorEnv, EnvSettings, Problem
from trainers.lm.model import ModelConfig, TinyLM, decode
from trainers.weights import to_device

CODEC = Codec(calculator.encode, calculator.decode, calculator.encode_observation, calculator.PAD)
MakeEnv = Callable[[int, int, EnvSettings], Environment]  # (data index, row, settings)


class Shape(Protocol):
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...


def build_agent(shape: Shape) -> TinyLM:
    """A fresh policy; its init draws from the global torch RNG (seeded by the runtime)."""
    return TinyLM(ModelConfig(
        vocab_size=calculator.VOCAB_SIZE, d_model=shape.d_model, n_layers=shape.n_layers,
        n_heads=shape.n_heads, max_len=calculator.MAX_LEN,
    ))  # fmt: skip


def calculator_env(seed: int, index: int, row: int, settings: EnvSettings) -> Environment:
    """The environment of episode ``row`` of the rollout of data ``index``."""
    return CalculatorEnv(settings, stable_seed("env", seed, index, row))


async def run_agent(
    ctx: RolloutContext, envs: Sequence[Environment], tasks: Sequence[Problem],
    generate: TurnFn, settings: EnvSettings, policy: TinyLM,
) -> list[Episode]:  # fmt: skip
    return await run_episodes(
        ctx, envs, tasks, generate, CODEC, max_turns=settings.max_turns,
        turn_tokens=settings.turn_tokens, max_len=policy.config.max_len,
        step_timeout_s=settings.step_timeout_s,
    )  # fmt: skip


async def evaluate_agent(
    policy: TinyLM, problems: list[Problem], settings: EnvSettings, lane: Lane | None,
    make_env: MakeEnv, device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """Greedy episodes on held-out problems without tool latency (its cost is not the
    policy's), generation on ``lane`` and ``device`` (the policy's): ``eval/reward``,
    ``eval/success``, ..."""
    settings = msgspec.structs.replace(settings, latency_ms=0.0)
    envs = [make_env(-1, row, settings) for row in range(len(problems))]
    ctx = RolloutContext(-1, torch.Generator(), lane=lane, track="eval")

    def greedy(transcripts: Tensor, width: int) -> Generated:
        policy.eval()
        with parallel.gathered(policy):  # decoding enters the model past its hooks
            # The runner's transcripts are built on the CPU: to the policy, once a turn.
            out = decode(policy, to_device(transcripts, device), width, stop_id=calculator.EOS)
        is_eos = out.tokens == calculator.EOS
        lengths = ((is_eos.cumsum(dim=1) - is_eos.long()) == 0).sum(dim=1)
        return Generated(out.tokens, out.logprobs, out.versions.expand_as(out.tokens), lengths)

    episodes = await run_agent(ctx, envs, problems, greedy, settings, policy)
    metrics = episode_metrics(episodes, problems)
    metrics["reward"] = metrics.pop("reward_mean")  # eval/reward: the shared name
    return {f"eval/{k}": v for k, v in metrics.items()}


def episode_metrics(
    episodes: list[Episode], problems: Sequence[Problem] | None
) -> dict[str, float]:
    """Mean reward and success (the exact answer, when the problems are known), turns,
    tool calls; counts of tool errors and of episodes whose environment failed."""
    finished = [e for e in episodes if e.trainable]
    metrics = {
        "reward_mean": statistics.fmean(e.reward for e in episodes),
        "reward_std": statistics.pstdev([e.reward for e in episodes]),
        "turns_mean": statistics.fmean(e.turns for e in episodes),
        "tool_calls_mean": statistics.fmean(e.tool_calls for e in episodes),
        "tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env_failures": float(len(episodes) - len(finished)),
    }
    if problems is not None:
        answers = [calculator.decode(_last_reply(e)) for e in episodes]
        metrics["success"] = statistics.fmean(
            float(e.status == "done" and a == p.answer)
            for e, a, p in zip(episodes, answers, problems, strict=True)
        )
    return metrics


def _last_reply(episode: Episode) -> list[int]:
    """The ids of the episode's last turn (its final answer when it ended "done")."""
    ids, trained = episode.ids, episode.trained
    end = max((i for i, t in enumerate(trained) if t), default=-1) + 1
    start = end
    while start > 0 and trained[start - 1]:
        start -= 1
    return ids[start:end]
