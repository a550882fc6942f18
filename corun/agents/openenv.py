"""OpenEnv environments as corun chat environments.

An OpenEnv environment (``openenv-core``: an ``Environment`` served by its FastAPI app)
is played through openenv's own client, ``EnvClient``: async, one WebSocket session per
client (``/ws``) and so one environment instance on the server per episode.
:class:`OpenEnvEnvironment` is one episode of it as a corun :class:`ChatEnvironment`::

    client = GenericEnvClient(base_url=url)  # or the environment's typed client
    env = OpenEnvEnvironment(client, seed=stable_seed("env", seed, index, row))

How the two APIs meet (the text convention, :class:`TextFields`):

- ``reset(task)`` connects (under ``connect_timeout_s``) and calls ``client.reset(seed=
  seed, **reset_kwargs(task))``; the observation's text field (``observation_field``,
  default ``"message"``) is the conversation's first user message, after the system
  prompt if any. The server passes a keyword to the environment's ``reset`` only if
  it takes it: ``seed`` (per episode, derived from (run seed, index, row) so a rerun
  draws the same and the episodes of one task differ) and, by default, ``task`` (the
  task of the run's dataset, so that a GRPO group plays one game).
- ``step(reply)`` sends the action ``{action_field: reply text}`` (default field
  ``"message"``, the field of openenv's template action) and answers with the
  observation's text field as the next user message. The step's reward (``None``:
  0) is the turn's: corun sums them into the episode's. ``done`` ends the episode.
- The policy is offered no function tools: its reply text is the action.

Every call has a deadline: the runner's ``env.step_timeout_s`` on ``reset`` and each
``step``, and ``connect_timeout_s`` on connecting inside it. Anything the client
raises (a server error, a closed connection, a value off the convention: a missing
field, an observation that is not text, a reward that is not a finite number) fails
that episode (the runner counts ``rollout/env_failures``), never the run.

The session is closed when its episode ends: done, an error, a timeout or a
cancellation (the close shielded and bounded), or, for an episode the runner cut at
its turn or token limit, by ``aclose`` at the end of the rollout.

openenv's client is asyncio code (``asyncio.wait_for``, ``websockets.asyncio``): runs
that use it run their loop on asyncio (corun's default), not trio.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from corun.agents.chat_runner import ChatStep
from corun.agents.threaded import finite_reward
from corun.contract.policy import ChatMessage, ToolSpec

CLOSE_TIMEOUT_S = 5.0  # closing a session: best effort, never a hang


class StepResult(Protocol):
    """What openenv's client returns from ``reset`` and ``step``."""

    observation: Any
    reward: float | None
    done: bool


class OpenEnvClient(Protocol):
    """What the adapter needs of openenv's ``EnvClient`` (any of its subclasses)."""

    async def connect(self) -> Any: ...

    async def reset(self, **kwargs: Any) -> Any: ...

    async def step(self, action: Any, **kwargs: Any) -> Any: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class TextFields:
    """Where the text goes: the action's field the reply fills, the observation's field
    read as the next user message."""

    action_field: str = "message"
    observation_field: str = "message"

    def action(self, text: str) -> dict[str, str]:
        """The action as ``GenericEnvClient`` sends it (a typed client needs its own
        ``action=`` builder, e.g. ``lambda text: MyAction(message=text)``)."""
        return {self.action_field: text}

    def text(self, observation: Any) -> str:
        """The observation's text field (a dict from ``GenericEnvClient``, a model from
        a typed client)."""
        name = self.observation_field
        if isinstance(observation, Mapping):
            if name not in observation:
                fields = ", ".join(map(str, observation)) or "none"
                raise KeyError(f"the observation has no field {name!r} (its fields: {fields})")
            value = observation[name]
        else:
            value = getattr(observation, name)
        if not isinstance(value, str):
            raise TypeError(f"the observation's {name!r} is a {type(value).__name__}, not text")
        return value


def task_kwargs(task: Any) -> dict[str, Any]:
    """The default reset keywords of a task: a mapping as it is, None as none, anything
    else as ``task=``."""
    if task is None:
        return {}
    return dict(task) if isinstance(task, Mapping) else {"task": task}


def step_reward(reward: object) -> float:
    """A step's reward as corun adds it up: None is 0; otherwise a finite int or float
    (the Gymnasium and SkyRL-Gym adapters' check), else the episode fails."""
    return 0.0 if reward is None else finite_reward(reward, "step()")


class OpenEnvEnvironment:
    """One episode of an OpenEnv environment through its client, in chat messages."""

    tools: Sequence[ToolSpec] = ()  # the reply's text is the action

    def __init__(
        self, client: OpenEnvClient, *, seed: int | None = None,
        fields: TextFields = TextFields(),
        action: Callable[[str], Any] | None = None,
        reset_kwargs: Callable[[Any], dict[str, Any]] = task_kwargs,
        system_prompt: str = "", connect_timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.client = client
        self.seed = seed
        self.fields = fields
        self.action = action or fields.action
        self.reset_kwargs = reset_kwargs
        self.system_prompt = system_prompt
        self.connect_timeout_s = connect_timeout_s
        self._closed = False

    async def reset(self, task: Any) -> list[ChatMessage]:
        async with self._episode_call():
            with anyio.fail_after(self.connect_timeout_s):
                await self.client.connect()
            seed = {} if self.seed is None else {"seed": self.seed}
            result: StepResult = await self.client.reset(**seed, **self.reset_kwargs(task))
            text = self.fields.text(result.observation)
        first = [ChatMessage(role="user", content=text)]
        if self.system_prompt:
            first.insert(0, ChatMessage(role="system", content=self.system_prompt))
        return first

    async def step(self, reply: ChatMessage) -> ChatStep:
        async with self._episode_call():
            result: StepResult = await self.client.step(self.action(reply.text()))
            text, reward = self.fields.text(result.observation), step_reward(result.reward)
            done = bool(result.done)
        if done:
            await self.aclose()
        return ChatStep([ChatMessage(role="user", content=text)], reward, done=done)

    async def aclose(self) -> None:
        """Close the session (once; shielded from cancellation, bounded, best effort: a
        session that cannot be closed is the server's to drop, not the run's error)."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT_S):
            with contextlib.suppress(Exception):
                await self.client.close()

    @contextlib.asynccontextmanager
    async def _episode_call(self) -> AsyncIterator[None]:
        """A reset or step: anything raised in it (a cancellation too) ends the episode
        and closes its session before it propagates."""
        if self._closed:
            raise RuntimeError("the episode is over and its session closed: one env per episode")
        try:
            yield
        except BaseException:
            await self.aclose()
            raise


def generic_client(
    url: str, *, connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0
) -> OpenEnvClient:
    """openenv's ``GenericEnvClient`` for the server at ``url`` (actions and observations
    as dicts: no environment package needed on this side)."""
    from openenv.core.generic_client import GenericEnvClient

    client: OpenEnvClient = GenericEnvClient(
        base_url=url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
    )
    return client
