"""Held-out evaluation of an HF policy: greedy replies to the held-out prompts, scored
by the run's reward functions. Greedy decoding draws no random numbers, so evaluating
never perturbs training."""

from __future__ import annotations

import torch

from corun.contract.engine import Sampling
from corun.engines import continuous
from corun.execution import parallel
from corun.execution.compute import Lane
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rewards import Rewards
from trainers.hf.tasks import Example


async def evaluate(
    policy: HFPolicy, chat: ChatFormat, examples: list[Example], max_new_tokens: int,
    rewards: Rewards, lane: Lane | None,
) -> dict[str, float]:  # fmt: skip
    """The mean reward and its standard error (``eval/reward``, ``eval/reward_se``),
    each function's mean (``eval/reward/<name>``), and where the examples come from
    several tasks (a generated source) each task's mean reward (``eval/score/<task>``)."""
    if not examples:
        return {}
    greedy = Sampling(max_new_tokens, 0.0, 1.0, (chat.eos_id,))

    def replies() -> list[str]:
        prompts = [chat.encode(e.prompt) for e in examples]
        with parallel.gathered(policy):  # decoding enters the model past its hooks
            generated = continuous.generate(policy, prompts, greedy, None, chat.pad_id)
        return [chat.decode(g.ids) for g in generated]

    responses = replies() if lane is None else await lane.run(replies)
    scores = await rewards.score(
        [str(e.prompt) for e in examples], responses, [e.answer for e in examples],
        None if lane is None else lane.run, [e.entry for e in examples],
    )  # fmt: skip
    values = torch.tensor(scores.rewards)
    se = float(values.std() / len(values) ** 0.5) if len(values) > 1 else 0.0
    return {
        "eval/reward": float(values.mean()),
        "eval/reward_se": se,
        **{f"eval/reward/{name}": value for name, value in scores.by_function.items()},
        **by_task(examples, scores.rewards),
    }


def by_task(examples: list[Example], rewards: list[float]) -> dict[str, float]:
    """Each task's mean reward over its examples (none for untasked data)."""
    totals: dict[str, list[float]] = {}
    for example, reward in zip(examples, rewards, strict=True):
        if example.task:
            totals.setdefault(example.task, []).append(reward)
    return {f"eval/score/{task}": sum(v) / len(v) for task, v in totals.items()}
