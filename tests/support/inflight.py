"""In-flight weight updates (``inflight_at_sync = "interrupt"``), checked the same way on
every engine that takes them: a long generation runs while the weights change twice;
the updates return while it still runs (no drain), every token carries the version
that produced it, in order, and each token's behaviour log-prob is compared with the
trainer's recomputation under that version's weights (:func:`mismatch_by_version`)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Awaitable, Callable

import anyio
import torch

from corun.contract.engine import Engine, Generation, Sampling
from tests.support.vllm_helpers import perturb, prompts, recompute
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rl import to_rollouts

LONG = Sampling(max_tokens=160)  # temperature 1, no stop: every row runs to the end
STEP_TOKENS = 24  # the tokens each row has generated before the next update


class MissedTiming(AssertionError):
    """The generation did not span the updates (it ended first, or an update waited for
    it): a timing the test could not arrange, not a wrong token."""


async def generate_across_syncs(
    engine: Engine, policy: HFPolicy, chat: ChatFormat,
    progress: Callable[[], Awaitable[int]],
    syncs: int = 2, count: int = 4, step_tokens: int = STEP_TOKENS,
    max_tokens: int = LONG.max_tokens, poll_s: float = 0.005,
    before_update: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[list[int]], list[Generation], list[HFPolicy]]:  # fmt: skip
    """``count`` prompts, their generations, and the policy of each version 0..``syncs``:
    an update each time every row has ``step_tokens`` more tokens (``progress``: the
    fewest tokens a running row has so far), while the generation runs
    (``before_update``, if given, runs just before each)."""
    rows = prompts(chat, count)
    await engine.update_weights(policy.weights(), 0)
    policies = [copy.deepcopy(policy)]
    got: list[Generation] = []
    done = anyio.Event()

    async def generate() -> None:
        sampling = dataclasses.replace(LONG, max_tokens=max_tokens)
        got.extend(await engine.generate(rows, sampling, seed=3))
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(generate)
        for version in range(1, syncs + 1):
            while await progress() < step_tokens * version:
                if done.is_set():
                    raise MissedTiming("the generation ended before the updates")
                await anyio.sleep(poll_s)
            if before_update is not None:
                await before_update()
            perturb(policy, seed=version)
            await engine.update_weights(policy.weights(), version)
            assert engine.version == version
            if done.is_set():
                raise MissedTiming(f"update {version} waited for the generation (drained)")
            policies.append(copy.deepcopy(policy))
    return rows, got, policies


def mismatch_by_version(
    rows: list[list[int]], generations: list[Generation], policies: list[HFPolicy],
    chat: ChatFormat,
) -> dict[int, tuple[float, float]]:  # fmt: skip
    """Per version: the largest |behaviour - recomputed| log-prob over its tokens, and
    the mean k3 estimate of KL(behaviour || recomputed) (``exp(d) - 1 - d`` with d the
    recomputed minus the behaviour log-prob), each token recomputed by the whole
    sequence under the weights of the version that produced it."""
    rollouts = to_rollouts(rows, generations, chat.pad_id)
    behaviour, mask = rollouts.logprobs, rollouts.response_mask
    versions = torch.zeros_like(behaviour, dtype=torch.long)
    for row, generation in enumerate(generations):
        versions[row, : len(generation.versions)] = torch.tensor(generation.versions)
    found: dict[int, tuple[float, float]] = {}
    for version, policy in enumerate(policies):
        where = mask & (versions == version)
        if not where.any():
            continue
        diff = recompute(policy, rollouts, LONG)[where] - behaviour[where]
        k3 = torch.exp(diff) - 1 - diff
        found[version] = (float(diff.abs().max()), float(k3.mean()))
    return found
