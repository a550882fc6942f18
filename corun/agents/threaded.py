"""Calls into a synchronous environment object from the event loop, one episode's: what
the adapters of synchronous frameworks share (Gymnasium's, gym.py; SkyRL-Gym's,
skyrl.py).

Each call runs in a worker thread (``anyio.to_thread``, under asyncio or trio), so a
slow env holds up only its own episode. What that asks of the caller:

- One env object per episode, never shared: calls of two episodes would run in two
  threads at once. Consecutive calls of one episode may run on different threads (an
  env tied to one thread is not supported).
- A cancelled call (the runner's ``step_timeout_s``) is abandoned, not stopped: Python
  cannot stop a thread. The episode ends at once ("timeout"), the env's call runs on in
  its thread, and further calls are refused.
- The env is closed when its episode ends: the adapter's ``close()`` once the env says
  done, or any error a call raises; an episode the chat runner cut at its turn or
  token limit, by ``aclose()`` at the end of its rollout. One that times out is
  dropped unclosed (its call still runs in its thread).
- Calls share anyio's default thread limiter (40 threads): the 41st concurrent call
  waits, and the wait counts against the step timeout; an abandoned call holds its
  thread until it returns. Raise the limit for many concurrent episodes with
  ``anyio.to_thread.current_default_thread_limiter().total_tokens = n``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

A = TypeVar("A")
R = TypeVar("R")


class EnvCalls:
    """The calls of one episode's synchronous env: one at a time, each in a worker
    thread, abandoned when cancelled, none after the episode ended."""

    def __init__(self, close_env: Callable[[], None]) -> None:
        self._close_env = close_env  # the env's own close(), run once its episode ends
        # Held while the env is in a call, in the call's thread: an abandoned call
        # (cancelled, still running) keeps it, so no second call overlaps it.
        self._in_call = threading.Lock()
        self._closed = False  # the episode ended and the env was closed

    async def run(self, fn: Callable[[A], R], arg: A) -> R:
        """``fn(arg)`` in a worker thread; an error it raises closes the env first."""
        # abandon_on_cancel: a cancelled call returns at once (the step timeout works);
        # without it, cancellation would wait for the env, a hung one forever.
        return await anyio.to_thread.run_sync(self._in_thread, fn, arg, abandon_on_cancel=True)

    async def aclose(self) -> None:
        """End an episode that no call ended (the runner cut it): close the env in a
        worker thread, best effort; nothing when it is closed already or still in an
        abandoned call."""
        if self._closed or self._in_call.locked():
            return
        with contextlib.suppress(Exception):  # an env that cannot close is not the run's error
            await self.run(lambda _: self.close(), None)

    def close(self, error: Exception | None = None) -> None:
        """End the episode from inside a call: close the env. With the ``error`` that
        ended it, an error of the close is a note on that one rather than raised."""
        self._closed = True
        try:
            self._close_env()
        except Exception as exc:
            if error is None:
                raise
            error.add_note(f"env.close() then raised {type(exc).__name__}: {exc}")

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
                self.close(exc)
                raise
        finally:
            self._in_call.release()


def finite_reward(reward: object, call: str = "step()") -> float:
    """An env's reward as a float: an int or a float (numpy's count; a bool does not, as
    in Gymnasium's own checker), finite; TypeError or ValueError naming ``call``."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(
            f"{call} returned the reward {reward!r} of type {type(reward).__name__}; it must "
            "be an int or a float (numpy's too)"
        )
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"{call} returned the reward {value}; it must be finite")
    return value


def shape(result: object) -> str:
    """What an API call returned, for a message: "a 4-tuple", "a list"."""
    if isinstance(result, tuple):
        return f"a {len(result)}-tuple"
    return f"a {type(result).__name__}"
