"""Continuous batching on the transformers engine (corun/engines/continuous.py).

The running batch, stepped by hand on the tiny Llama: a call that joins a running one
mid-way, or leaves before it, computes what it computes alone (tokens, log-probs,
versions), with its cache padded and cut, or re-read where the cache cannot be; a call
that does not fit waits, in order; new weights mid-way re-read every row. The engine:
a short call begun during a long one returns first; a drained update waits for the
calls begun before it and holds back those begun after; a caller that leaves takes its
rows out, and the engine drains.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from corun.contract.engine import Generation, Sampling
from corun.engines import continuous
from corun.engines.continuous import Call, RunningBatch
from corun.engines.transformers_engine import TransformersEngine
from corun.execution.compute import Lane
from trainers.hf.policy import HFPolicy, load_policy

PAD = 0
LONG = [[5, 9, 11, 40, 7], [8, 3]]  # prompts of two lengths: left padding within a call
SHORT = [list(range(12, 24)), [21], [30, 31]]


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    torch.manual_seed(0)
    return load_policy("tiny-llama", "test")[0]


def sampled(max_tokens: int, **extra: Any) -> Sampling:
    return Sampling(max_tokens, temperature=1.0, top_p=0.9, top_logprobs=2, **extra)


def call(prompts: list[list[int]], sampling: Sampling, seed: int) -> Call:
    return Call(prompts, sampling, torch.Generator().manual_seed(seed))


def alone(policy: HFPolicy, prompts: list[list[int]], sampling: Sampling, seed: int,
          weights_version: Callable[[], int] = lambda: 0) -> list[Generation]:  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    return continuous.generate(policy, prompts, sampling, generator, PAD, weights_version)


def assert_same(got: list[Generation] | None, want: list[Generation]) -> None:
    assert got is not None and len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.ids == theirs.ids
        assert mine.versions == theirs.versions and mine.finish == theirs.finish
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
        assert mine.top is not None and theirs.top is not None
        assert [[t for t, _ in step] for step in mine.top] == [
            [t for t, _ in step] for step in theirs.top
        ]


@pytest.mark.parametrize("cache", ["joined", "re-read"])
def test_a_call_joining_and_leaving_mid_way_computes_what_it_does_alone(
    policy: HFPolicy, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cache == "re-read":  # a cache the batch cannot pad or cut: dropped, and re-read
        monkeypatch.setattr(continuous, "_layers", lambda _: None)
    long_sampling, short_sampling = sampled(30), sampled(6)
    batch = RunningBatch(policy.model, PAD)
    long, short = call(LONG, long_sampling, 1), call(SHORT, short_sampling, 2)
    batch.submit(long)
    for _ in range(5):
        assert batch.step() == []
    batch.submit(short)  # a prompt wider than the running rows: they are padded too
    finished = [batch.step() for _ in range(6)]
    assert finished[:5] == [[]] * 5 and finished[5] == [short]
    assert not long.over and batch.ids.shape[0] == len(LONG)  # the short rows left
    assert batch.ids.shape[1] == len(LONG[0]) + 11  # its padding columns went with them
    while not long.over:
        batch.step()
    assert batch.idle and batch.calls == [] and batch.cache is None
    assert_same(short.result, alone(policy, SHORT, short_sampling, 2))
    assert_same(long.result, alone(policy, LONG, long_sampling, 1))


def test_a_call_that_does_not_fit_waits_for_rows_in_order(policy: HFPolicy) -> None:
    batch = RunningBatch(policy.model, PAD, max_rows=3)
    first, second, third = (call(LONG, sampled(4), 1), call(LONG, sampled(4), 2),
                            call([[9]], sampled(4), 3))  # fmt: skip
    for waiting in (first, second, third):
        batch.submit(waiting)
    for _ in range(3):
        batch.step()
        # the third would fit beside the first, but does not pass the second
        assert batch.calls == [first] and not second.tokens and not third.tokens
    assert batch.step() == [first]
    batch.step()
    assert batch.calls == [second, third]  # 2 + 1 rows: both fit now


def test_new_weights_mid_way_re_read_every_row(policy: HFPolicy) -> None:
    """Weights change at a step while two calls run: every row is re-read by them, and
    the long call gets what it gets alone under the same schedule."""
    model = policy.model
    original = {k: v.clone() for k, v in model.state_dict().items()}
    long_sampling, short_sampling = sampled(20), sampled(12)

    def switching_at(step: int) -> Callable[[], int]:
        asked = [0]

        def weights_version() -> int:
            asked[0] += 1
            if asked[0] == step:  # new weights, between two decode steps
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.mul_(1.01)
            return int(asked[0] >= step)

        return weights_version

    try:
        want = alone(policy, LONG, long_sampling, 1, switching_at(8))
        model.load_state_dict(original)
        batch = RunningBatch(model, PAD)
        long, short = call(LONG, long_sampling, 1), call(SHORT, short_sampling, 2)
        batch.submit(long)
        version = switching_at(8)
        for _ in range(4):
            batch.step(version)
        batch.submit(short)
        while not long.over:
            batch.step(version)
    finally:
        model.load_state_dict(original)
    assert_same(long.result, want)
    assert want[0].versions == [0] * 7 + [1] * 13
    assert short.result is not None and short.result[0].versions == [0] * 3 + [1] * 9


@pytest.fixture
def engine(policy: HFPolicy) -> TransformersEngine:
    engine = TransformersEngine(policy, PAD, Lane("engine"), owns_lane=True, interrupt=False)

    def slowed(*_: Any) -> None:
        time.sleep(0.01)  # a decode step of a larger model

    engine.model.register_forward_hook(slowed)
    return engine


@pytest.mark.anyio
async def test_a_short_call_begun_during_a_long_one_returns_first(
    engine: TransformersEngine, policy: HFPolicy
) -> None:
    done: list[str] = []
    results: dict[str, list[Generation]] = {}

    async def generate(name: str, prompts: list[list[int]], sampling: Sampling, seed: int) -> None:
        results[name] = await engine.generate(prompts, sampling, seed)
        done.append(name)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(generate, "long", LONG, sampled(60), 1)
            await anyio.sleep(0.1)
            tasks.start_soon(generate, "short", SHORT, sampled(5), 2)
        await engine.shutdown()
    assert done == ["short", "long"]
    assert_same(results["short"], alone(policy, SHORT, sampled(5), 2))
    assert_same(results["long"], alone(policy, LONG, sampled(60), 1))


@pytest.mark.anyio
async def test_a_drained_update_waits_for_calls_before_it_and_holds_back_those_after(
    engine: TransformersEngine, policy: HFPolicy
) -> None:
    events: list[str] = []
    results: dict[str, list[Generation]] = {}
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}

    async def generate(name: str, max_tokens: int) -> None:
        results[name] = await engine.generate(LONG, sampled(max_tokens), 3)
        events.append(name)

    async def update() -> None:
        await engine.update_weights(state, 1)
        events.append("update")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(generate, "before", 30)
            await anyio.sleep(0.1)
            tasks.start_soon(update)
            await anyio.sleep(0.05)
            tasks.start_soon(generate, "after", 2)
        await engine.shutdown()
    assert events == ["before", "update", "after"]
    assert {v for g in results["before"] for v in g.versions} == {0}
    assert {v for g in results["after"] for v in g.versions} == {1}


@pytest.mark.anyio
async def test_a_caller_that_leaves_takes_its_rows_out(
    engine: TransformersEngine, policy: HFPolicy
) -> None:
    results: dict[str, list[Generation]] = {}

    async def generate(name: str, prompts: list[list[int]], max_tokens: int) -> None:
        results[name] = await engine.generate(prompts, sampled(max_tokens), 4)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(generate, "stays", LONG, 25)
            async with anyio.create_task_group() as left:
                left.start_soon(generate, "leaves", SHORT, 500)
                await anyio.sleep(0.15)
                left.cancel_scope.cancel()
        await engine.pause()  # drained: nothing is left running
        assert engine._batch.idle and engine._batch.calls == []
        await engine.shutdown()
    assert "leaves" not in results
    assert_same(results["stays"], alone(policy, LONG, sampled(25), 4))
