"""Compute lanes: blocking torch work runs off the event loop.

A lane is a capacity-1 limiter over anyio's worker threads, so calls on one lane
never overlap. Cancellation never abandons a running call (the thread may hold
tensors that the next call needs): the awaiting task waits for the call to return.
To keep Ctrl-C fast, blocking code calls :func:`cancel_point` between micro-batches
or decode steps; inside a lane call it raises the host task's cancellation.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

T = TypeVar("T")
ComputeMode = Literal["thread", "inline"]

_lane_local = threading.local()


def cancel_point() -> None:
    """Raise the awaiting task's cancellation here if it has been cancelled.

    A no-op outside a threaded lane call (inline mode, plain scripts, tests that
    call trainer methods directly), so trainer code can call it unconditionally.
    """
    if getattr(_lane_local, "active", False):
        anyio.from_thread.check_cancelled()


def _call_in_lane(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    _lane_local.active = True
    try:
        return fn(*args)
    finally:
        _lane_local.active = False


class Lane:
    """One stream of blocking calls, run in order on a worker thread (or inline)."""

    def __init__(self, name: str, mode: ComputeMode = "thread") -> None:
        self.name = name
        self.mode = mode
        self._limiter = anyio.CapacityLimiter(1)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.mode == "inline":
            # Lowest overhead; the event loop is blocked for the call's duration.
            return fn(*args)
        return await anyio.to_thread.run_sync(_call_in_lane, fn, args, limiter=self._limiter)


async def call_hook(lane: Lane, hook: Callable[..., Any], *args: Any) -> Any:
    """Await an async hook on the loop; run a plain one on ``lane``."""
    if inspect.iscoroutinefunction(hook):
        return await hook(*args)
    result = await lane.run(hook, *args)
    if inspect.isawaitable(result):
        return await _await(result)
    return result


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable
