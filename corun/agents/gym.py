"""Gymnasium text environments as corun environments.

An environment written for the Gymnasium API — ``reset(seed=, options=) -> (observation,
info)`` and ``step(action) -> (observation, reward, terminated, truncated, info)`` — whose
observations and actions are text (``gymnasium.spaces.Text``) trains with corun once a
trainer's ``make_env`` hook wraps a fresh one per episode::

    def make_env(self, index: int, row: int, settings: EnvSettings) -> Environment:
        seed = stable_seed("env", self.run_config.run.seed, index, row)
        return GymEnvironment(MyTextEnv(), seed=seed)

How the two APIs meet:

- ``reset(task)`` calls ``env.reset(seed=seed, options={"task": task})`` and returns the
  observation, the episode's prompt (``options=`` maps a task to other reset options).
  The seed is per episode, not derived from the task: the ``samples_per_prompt``
  episodes of one task would otherwise share every random draw of the env. Derive it
  from (run seed, index, row) as above and a rerun or a resume draws the same; ``None``
  seeds from fresh entropy (not reproducible).
- ``step(reply)`` calls ``env.step(reply)``. ``done`` is ``terminated or truncated``:
  corun does not bootstrap, so an episode cut by the env's time limit ends like one that
  terminated (its rewards so far are its return). The info keys ``tool_call`` and
  ``tool_error`` become the Step's flags. The reply is passed as it is, even when it is
  outside the action space: a malformed reply is the env's to answer.
- A value off the API — a reward that is not a finite int or float (numpy's count; a
  bool does not, as in Gymnasium's own checker), an observation that is not text, the
  four-tuple of gym < 0.26 — raises TypeError or ValueError from the call. corun's
  runner ends that episode "failed" with the message, as for anything the env raises.
- The env is closed when its episode ends: done, or any error. An episode that the
  runner cuts at its turn or token limit, or that times out, is dropped unclosed.

Threads. Gymnasium environments are synchronous, so each call runs in a worker thread
(corun/agents/threaded.py): one env object per episode (``make_env`` builds one per
episode), a cancelled call abandoned, not stopped, and anyio's thread limit; its
docstring says what that asks of the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from corun.agents.threaded import EnvCalls, finite_reward, shape
from corun.contract.episodes import Step

if TYPE_CHECKING:
    from gymnasium import Env


def task_options(task: Any) -> dict[str, Any]:
    """The default reset options: the task under ``"task"``."""
    return {"task": task}


class GymEnvironment:
    """One episode of a Gymnasium text env, as a corun :class:`Environment`."""

    def __init__(
        self, env: Env[str, str], *, seed: int | None = None,
        options: Callable[[Any], dict[str, Any] | None] = task_options,
    ) -> None:  # fmt: skip
        self.env = env
        self.seed = seed
        self.options = options
        self._calls = EnvCalls(env.close)

    async def reset(self, task: Any) -> str:
        return await self._calls.run(self._reset, task)

    async def step(self, reply: str) -> Step:
        return await self._calls.run(self._step, reply)

    # ---- in the worker thread

    def _reset(self, task: Any) -> str:
        result = self.env.reset(seed=self.seed, options=self.options(task))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"reset() returned {shape(result)}, not (observation, info); an observation "
                "alone is the API of gym < 0.26"
            )
        return _text(result[0], "reset()")

    def _step(self, reply: str) -> Step:
        result = self.env.step(reply)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(
                f"step() returned {shape(result)}, not (observation, reward, terminated, "
                "truncated, info); a 4-tuple with one `done` is the API of gym < 0.26"
            )
        observation, reward, terminated, truncated, info = result
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, bool | np.bool_):
                raise TypeError(f"step() returned {name}={flag!r}; it must be a bool")
        if not isinstance(info, Mapping):
            raise TypeError(f"step() returned info of type {type(info).__name__}, not a dict")
        step = Step(
            _text(observation, "step()"), finite_reward(reward), bool(terminated or truncated),
            tool_call=bool(info.get("tool_call", False)),
            tool_error=bool(info.get("tool_error", False)),
        )  # fmt: skip
        if step.done:
            self._calls.close()
        return step


def _text(observation: object, call: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(
            f"{call} returned an observation of type {type(observation).__name__}; corun's "
            "policies read text (gymnasium.spaces.Text)"
        )
    return observation
