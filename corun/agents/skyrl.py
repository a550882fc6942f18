"""SkyRL-Gym text environments as corun chat environments.

A SkyRL-Gym environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``) is built per
episode from a row of SkyRL's dataset format — ``prompt`` (chat messages),
``env_class``, ``reward_spec`` (``{"ground_truth": ...}``), ``extra_info`` — and
speaks messages: ``init(prompt) -> (prompt, metadata)``, ``step(action) ->
{"observations", "reward", "done", "metadata"}``. One episode of one is a corun
:class:`~corun.agents.chat_runner.ChatEnvironment`, so a chat policy trains on it with
the chat episode runner::

    def make_env(self, index: int, row: int, settings: EnvSettings) -> ChatEnvironment:
        return SkyRLEnvironment(registered("gsm8k_multi_turn"))

How the two APIs meet:

- ``reset(row)`` builds the env from the row (``make``; :func:`registered` makes a
  registered id with the row's other keys as ``extras``, as SkyRL's own generator does)
  and returns the messages ``env.init(row["prompt"])`` gives: the episode's prompt.
- ``step(reply)`` calls ``env.step`` with the reply's text (the action: what the model
  wrote, its tool calls in its own words; SkyRL envs parse them from the text, so the
  adapter offers the template no tools). The observations are the next messages, the
  reward is the turn's, ``done`` ends the episode. ``postprocessed_action`` and
  ``metadata`` are not read: corun trains the ids it sampled, never a rewrite of them.
- A value off the API — an ``init`` that is not a (messages, metadata) pair, a step
  output that is not a dict of those keys, messages that are not a list of role/content
  dicts (roles: system, developer, user, assistant, tool), a reward that is not a
  finite number, a ``done`` that is not a bool — raises TypeError or ValueError from the
  call; corun's runner ends that episode "failed" with the message, as for anything
  the env raises.
- SkyRL envs are synchronous: every call, the env's construction included, runs in a
  worker thread as Gymnasium's do (corun/agents/threaded.py: one env per episode, a
  timed-out call abandoned, the env closed once done, on any error, or by ``aclose``
  when the runner cut its episode at the turn or token limit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from corun.agents.chat_runner import ChatStep
from corun.agents.threaded import EnvCalls, finite_reward, shape
from corun.contract.policy import ChatMessage, ToolSpec

if TYPE_CHECKING:
    from skyrl_gym.envs.base_text_env import BaseTextEnv

# A dataset row (SkyRL's format) -> the env of its episode.
MakeEnv = Callable[[Mapping[str, Any]], "BaseTextEnv"]
STEP_KEYS = ("observations", "reward", "done")


def registered(env_id: str, env_config: Mapping[str, Any] | None = None) -> MakeEnv:
    """Build the SkyRL-Gym env registered as ``env_id`` for a row: ``env_config`` its
    settings, the row's keys but ``prompt`` and ``env_class`` its ``extras``."""

    def make(row: Mapping[str, Any]) -> BaseTextEnv:
        import skyrl_gym  # the `skyrl` extra: needed only by a run that names an env

        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        env: BaseTextEnv = skyrl_gym.make(env_id, env_config=dict(env_config or {}), extras=extras)
        return env

    return make


class SkyRLEnvironment:
    """One episode of a SkyRL-Gym text env, as a corun :class:`ChatEnvironment`."""

    tools: Sequence[ToolSpec] = ()  # the env parses its tools out of the reply's text

    def __init__(self, make: MakeEnv) -> None:
        self.make = make
        self.env: BaseTextEnv | None = None  # built by reset()
        self._calls = EnvCalls(self._close_env)

    async def reset(self, task: Mapping[str, Any]) -> list[ChatMessage]:
        return await self._calls.run(self._init, task)

    async def step(self, reply: ChatMessage) -> ChatStep:
        return await self._calls.run(self._step, reply.text())

    async def aclose(self) -> None:
        """Close the env of an episode the runner cut (the chat runner calls it at the
        end of the rollout); nothing once it is closed."""
        await self._calls.aclose()

    # ---- in the worker thread

    def _init(self, row: Mapping[str, Any]) -> list[ChatMessage]:
        if self.env is not None:
            raise RuntimeError("reset() twice: one env per episode")
        self.env = self.make(row)
        result = self.env.init([dict(m) for m in row["prompt"]])  # the env's own copy
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"init() returned {shape(result)}, not (prompt, metadata)")
        return messages(result[0], "init()")

    def _step(self, action: str) -> ChatStep:
        assert self.env is not None, "reset() first"
        output = self.env.step(action)
        if not (isinstance(output, Mapping) and all(k in output for k in STEP_KEYS)):
            raise TypeError(
                f"step() returned {shape(output)}; it must be a dict with the keys "
                f"{', '.join(STEP_KEYS)} (BaseTextEnvStepOutput)"
            )
        done = output["done"]
        if not isinstance(done, bool):
            raise TypeError(f"step() returned done={done!r}; it must be a bool")
        step = ChatStep(
            messages(output["observations"], "step()"), finite_reward(output["reward"]), done
        )
        if done:
            self._calls.close()
        return step

    def _close_env(self) -> None:
        if self.env is not None:
            self.env.close()


def messages(value: object, call: str) -> list[ChatMessage]:
    """SkyRL's messages (a list of ``{"role", "content"}`` dicts) as corun's; TypeError
    naming ``call`` and the message when they are not."""
    if not isinstance(value, list):
        raise TypeError(f"{call} returned messages of type {type(value).__name__}, not a list")
    try:
        return msgspec.convert(value, list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise TypeError(
            f"{call} returned messages off the chat format ({exc}); each must be a dict "
            "with a role (system, developer, user, assistant, tool) and a text content"
        ) from None
