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
  runner cuts at its turn or token limit, or that times out, is dropped unclosed (the
  Environment protocol has no end-of-episode call, and a timed-out call still runs).

Threads. Gymnasium environments are synchronous, so each call runs in a worker thread
(``anyio.to_thread``, under asyncio or trio) and a slow env holds up only its own
episode. What that asks of the caller:

- One env object per episode, never shared: calls of two episodes would run in two
  threads at once. ``make_env`` builds one per episode. Consecutive calls of one
  episode may run on different threads (an env tied to one thread is not supported).
- A cancelled call (the runner's ``step_timeout_s``) is abandoned, not stopped: Python
  cannot stop a thread. The episode ends at once ("timeout"), the env's call runs on in
  its thread, and this adapter refuses further calls.
- Calls share anyio's default thread limiter (40 threads): the 41st concurrent call
  waits, and the wait counts against the step timeout; an abandoned call holds its
  thread until it returns. Raise the limit for many concurrent episodes with
  ``anyio.to_thread.current_default_thread_limiter().total_tokens = n``.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np

from corun.contract.episodes import Step

if TYPE_CHECKING:
    from gymnasium import Env

A = TypeVar("A")
R = TypeVar("R")


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
        # Held while the env is in a call, in the call's thread: an abandoned call
        # (cancelled, still running) keeps it, so no second call overlaps it.
        self._in_call = threading.Lock()
        self._closed = False  # the episode ended and the env was closed

    async def reset(self, task: Any) -> str:
        return await self._call(self._reset, task)

    async def step(self, reply: str) -> Step:
        return await self._call(self._step, reply)

    async def _call(self, fn: Callable[[A], R], arg: A) -> R:
        # abandon_on_cancel: a cancelled call returns at once (the step timeout works);
        # without it, cancellation would wait for the env, a hung one forever.
        return await anyio.to_thread.run_sync(self._in_thread, fn, arg, abandon_on_cancel=True)

    # ---- in the worker thread

    def _in_thread(self, fn: Callable[[A], R], arg: A) -> R:
        if not self._in_call.acquire(blocking=False):
            raise RuntimeError(
                "the env is still in an earlier call (one that timed out or was cancelled "
                "runs on in its thread); this episode is over"
            )
        try:
            if self._closed:
                raise RuntimeError("the episode is over and its env closed: one env per episode")
            try:
                return fn(arg)
            except Exception as exc:  # the episode fails: close the env, report its error
                self._close(exc)
                raise
        finally:
            self._in_call.release()

    def _reset(self, task: Any) -> str:
        result = self.env.reset(seed=self.seed, options=self.options(task))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"reset() returned {_shape(result)}, not (observation, info); an observation "
                "alone is the API of gym < 0.26"
            )
        return _text(result[0], "reset()")

    def _step(self, reply: str) -> Step:
        result = self.env.step(reply)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(
                f"step() returned {_shape(result)}, not (observation, reward, terminated, "
                "truncated, info); a 4-tuple with one `done` is the API of gym < 0.26"
            )
        observation, reward, terminated, truncated, info = result
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, bool | np.bool_):
                raise TypeError(f"step() returned {name}={flag!r}; it must be a bool")
        if not isinstance(info, Mapping):
            raise TypeError(f"step() returned info of type {type(info).__name__}, not a dict")
        step = Step(
            _text(observation, "step()"), _reward(reward), bool(terminated or truncated),
            tool_call=bool(info.get("tool_call", False)),
            tool_error=bool(info.get("tool_error", False)),
        )  # fmt: skip
        if step.done:
            self._close()
        return step

    def _close(self, error: Exception | None = None) -> None:
        self._closed = True
        try:
            self.env.close()
        except Exception as exc:
            if error is None:
                raise
            error.add_note(f"env.close() then raised {type(exc).__name__}: {exc}")


def _text(observation: object, call: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(
            f"{call} returned an observation of type {type(observation).__name__}; corun's "
            "policies read text (gymnasium.spaces.Text)"
        )
    return observation


def _reward(reward: object) -> float:
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(
            f"step() returned the reward {reward!r} of type {type(reward).__name__}; it must "
            "be an int or a float (numpy's too)"
        )
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"step() returned the reward {value}; it must be finite")
    return value


def _shape(result: object) -> str:
    if isinstance(result, tuple):
        return f"a {len(result)}-tuple"
    return f"a {type(result).__name__}"
