"""The Gymnasium adapter (corun/agents/gym.py): a multi-turn text env with a lookup
tool step by step, terminated and truncated, values off the API, environments that
raise or hang inside corun's episode runner, and a slow env step that leaves the event
loop free."""

from __future__ import annotations

import string
import threading
from typing import Any

import anyio
import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.wrappers import TimeLimit

import corun
from corun.agents.gym import GymEnvironment
from corun.agents.runner import Codec, Generated, run_episodes
from corun.contract.episodes import Step

TEXT = spaces.Text(64, min_length=0, charset=string.ascii_lowercase + " ?#")


class LookupEnv(gymnasium.Env[str, str]):
    """What does a key hold? ``get <key>`` looks it up (a tool call; an unknown key is a
    tool error); any other reply is the final answer, 1 when exact."""

    TABLE = {"colour": "blue", "animal": "cat"}  # noqa: RUF012

    def __init__(self) -> None:
        self.observation_space = TEXT
        self.action_space = TEXT
        self.key = ""
        self.closed = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        assert options is not None
        self.key = options["task"]
        return f"what is the {self.key}? #{self.np_random.integers(100)}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action.startswith("get "):
            value = self.TABLE.get(action.removeprefix("get "))
            if value is None:
                return "no such key", 0.0, False, False, {"tool_call": True, "tool_error": True}
            return value, 0.0, False, False, {"tool_call": True}
        return "", float(action == self.TABLE[self.key]), True, False, {}

    def close(self) -> None:
        self.closed += 1


class ReturnsEnv(LookupEnv):
    """Every step returns ``result``, whatever it is."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result

    def step(self, action: str) -> Any:
        return self.result


class RaisingEnv(LookupEnv):
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise ConnectionError("sandbox went away")


class BlockingEnv(LookupEnv):
    """A step blocks its thread until ``release`` (at most 5 s, so no test hangs)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.entered.set()
        if not self.release.wait(timeout=5):
            raise TimeoutError("nobody released the step: the event loop was blocked")
        return super().step(action)


# ----------------------------------------------------------------------------- one episode


@pytest.mark.anyio
async def test_a_tool_episode_step_by_step(anyio_backend: str) -> None:
    env = LookupEnv()
    adapter = GymEnvironment(env, seed=3)
    with anyio.fail_after(5):
        prompt = await adapter.reset("colour")
        assert await adapter.step("get color") == Step(
            "no such key", tool_call=True, tool_error=True
        )
        assert await adapter.step("get colour") == Step("blue", tool_call=True)
        assert env.closed == 0
        assert await adapter.step("blue") == Step("", 1.0, done=True)
        assert env.closed == 1  # the episode ended: the env is closed
        with pytest.raises(RuntimeError, match="episode is over"):
            await adapter.step("blue")
        # The seed reaches the env's reset: the same seed, the same draws.
        assert await GymEnvironment(LookupEnv(), seed=3).reset("colour") == prompt
    assert prompt.startswith("what is the colour? #")


@pytest.mark.parametrize("end", ["terminated", "truncated"])
@pytest.mark.anyio
async def test_terminated_and_truncated_both_end_the_episode(anyio_backend: str, end: str) -> None:
    """Truncation by Gymnasium's own TimeLimit ends the episode like termination; the
    reward is the env's either way."""
    env = LookupEnv()
    adapter = GymEnvironment(TimeLimit(env, max_episode_steps=2))
    with anyio.fail_after(5):
        await adapter.reset("animal")
        assert not (await adapter.step("get animal")).done
        last = await adapter.step("cat" if end == "terminated" else "get colour")
    assert last.done and env.closed == 1
    assert last == (Step("", 1.0, done=True) if end == "terminated" else
                    Step("blue", 0.0, done=True, tool_call=True))  # fmt: skip


# ----------------------------------------------------------------------------- off the API


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        (("", "1", True, False, {}), TypeError, "reward '1' of type str"),
        (("", None, True, False, {}), TypeError, "reward None"),
        (("", True, True, False, {}), TypeError, "reward True of type bool"),
        (("", np.array(1.0), True, False, {}), TypeError, "of type ndarray"),
        (("", float("nan"), True, False, {}), ValueError, "must be finite"),
        ((7, 1.0, True, False, {}), TypeError, "observation of type int"),
        (("", 1.0, True, {}), TypeError, "4-tuple"),
        (("", 1.0, 1, False, {}), TypeError, "terminated=1"),
        (("", 1.0, True, False, None), TypeError, "info of type NoneType"),
    ],
)
@pytest.mark.anyio
async def test_values_off_the_api_raise_and_close(
    anyio_backend: str, result: Any, error: type[Exception], match: str
) -> None:
    env = ReturnsEnv(result)
    adapter = GymEnvironment(env)
    with anyio.fail_after(5):
        await adapter.reset("colour")
        with pytest.raises(error, match=match):
            await adapter.step("blue")
    assert env.closed == 1


@pytest.mark.anyio
async def test_numpy_rewards_and_flags_are_numbers(anyio_backend: str) -> None:
    adapter = GymEnvironment(ReturnsEnv(("", np.float32(0.5), np.bool_(True), False, {})))
    with anyio.fail_after(5):
        await adapter.reset("colour")
        step = await adapter.step("blue")
    assert step == Step("", 0.5, done=True) and type(step.reward) is float


# ----------------------------------------------------------------------------- in the runner

CODEC = Codec(
    encode=lambda text: [ord(c) for c in text],
    decode=lambda ids: "".join(map(chr, ids)),
    encode_observation=lambda text: [ord(c) for c in text],
    pad=0,
)


def scripted(*replies: str) -> Any:
    """A turn function that gives every episode the same reply each turn."""
    turns = iter(replies)

    def generate(transcripts: torch.Tensor, width: int) -> Generated:
        ids = CODEC.encode(next(turns))
        assert len(ids) <= width
        rows = len(transcripts)
        tokens = torch.tensor([ids] * rows)
        zeros = torch.zeros_like(tokens)
        return Generated(tokens, zeros.float(), zeros, torch.full((rows,), len(ids)))

    return generate


@pytest.mark.anyio
async def test_broken_envs_fail_their_episodes_in_the_runner(anyio_backend: str) -> None:
    """A well-behaved env runs to its answer; one that raises, one with a non-number
    reward and one that hangs past the step timeout end their own episodes; the hung
    env's thread runs on and its adapter refuses another call."""
    blocking = BlockingEnv()
    raising = RaisingEnv()
    envs = [LookupEnv(), raising, ReturnsEnv(("", "1", True, False, {})), blocking]
    adapters = [GymEnvironment(env) for env in envs]
    ctx = corun.RolloutContext(0, torch.Generator())
    try:
        with anyio.fail_after(5):
            episodes = await run_episodes(
                ctx, adapters, ["colour"] * 4, scripted("get colour", "blue"), CODEC,
                max_turns=3, turn_tokens=16, max_len=128, step_timeout_s=0.2,
            )  # fmt: skip
            assert blocking.entered.is_set()
            with pytest.raises(RuntimeError, match="still in an earlier call"):
                await adapters[3].step("blue")
    finally:
        blocking.release.set()
    assert [e.status for e in episodes] == ["done", "failed", "failed", "timeout"]
    assert episodes[0].reward == 1.0 and episodes[0].turns == 2 and episodes[0].tool_calls == 1
    assert episodes[1].reason == "ConnectionError: sandbox went away"
    assert episodes[2].reason.startswith("TypeError: step() returned the reward '1'")
    assert raising.closed == 1 and blocking.closed == 0  # a call still runs: not closed


@pytest.mark.anyio
async def test_a_slow_step_leaves_the_loop_free(anyio_backend: str) -> None:
    """The env's step blocks its thread until a task on the event loop has ticked three
    times while it runs; were the step run on the loop, nothing would tick, and the
    step would give up after 5 s with TimeoutError."""
    env = BlockingEnv()
    adapter = GymEnvironment(env)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        assert await anyio.to_thread.run_sync(env.entered.wait, 5)
        for _ in range(3):
            ticks += 1
            await anyio.sleep(0.001)  # a timer fires while the step blocks its thread
        env.release.set()

    with anyio.fail_after(5):
        await adapter.reset("colour")
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            step = await adapter.step("blue")
    assert ticks == 3 and step == Step("", 1.0, done=True)
