"""Deadlines on calls into a user's code: :func:`deadline` for a block of awaits (an
evaluation, a data fetch, a checkpoint write, an ``async def`` reward function) and
:class:`CallDeadlines` for each of a series of plain calls made inside one blocking
call on a compute lane (a reward function over a batch's samples).

Here, below ``corun.loop``, because trainers call it too: a user's reward functions
(the hf kinds' ``trainer.rewards``) are all called by trainers/hf/rewards.py, which
bounds each call with these; a trainer of the user's own can do the same.
corun/loop/deadlines.py re-exports :class:`DeadlineError` and :func:`deadline` for the
loop's own deadlines (weight syncs, engine calls).

What a deadline can cut. Python cannot stop a thread: a call stuck in its thread (a
blocking C call, a socket without a timeout) is *abandoned* — the awaiting task goes
on failing, the lane's later calls move to a fresh thread, and the stuck one is left
to its call and in :func:`corun.execution.compute.abandoned_threads`, so ``corun``
ends the process with ``os._exit`` rather than wait for it. The cost of a reward
function that hangs is one thread per hang, and the run ends. On the event loop
(``loop.compute = "inline"``, an ``async def`` function that blocks instead of
awaiting) nothing can interrupt a blocking call: a deadline there bounds awaits only.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio

from corun.execution.compute import ABANDON_GRACE_S, abandoning

T = TypeVar("T")
# How often a watch looks for a call to start (it sleeps to each call's deadline while
# one runs): the delay past a deadline before the overrun is seen, at most.
_POLL_S = 0.05


class DeadlineError(RuntimeError):
    """Something bounded by a deadline did not finish in time; one line (exit 1)."""


def overran(what: str, timeout_s: float, setting: str) -> DeadlineError:
    """The one line: "<what> did not finish within <timeout_s> s (<setting>)"."""
    return DeadlineError(f"{what} did not finish within {timeout_s:g} s ({setting})")


@contextmanager
def deadline(what: str, timeout_s: float, setting: str) -> Iterator[None]:
    """Cancel the block at ``timeout_s`` (abandoning a stuck lane call after its grace)
    and raise :class:`DeadlineError` for it: "<what> did not finish within ..."."""
    with (
        abandoning(min(timeout_s, ABANDON_GRACE_S)),
        anyio.CancelScope(deadline=anyio.current_time() + timeout_s) as scope,
    ):
        yield
    if scope.cancelled_caught and anyio.current_time() >= scope.deadline:
        raise overran(what, timeout_s, setting)


def quoted(text: str, limit: int = 80) -> str:
    """``text`` on one line in double quotes, cut to ``limit`` characters (a prompt in
    an error line)."""
    flat = " ".join(text.split())
    return '"' + (flat if len(flat) <= limit else flat[: limit - 3] + "...") + '"'


class CallDeadlines:
    """A deadline for each plain call made through :meth:`call` inside the blocking
    work that :meth:`run` awaits on a compute lane.

    The work runs on the lane's thread as one call (no thread hop per user call); the
    thread notes which call it is in and since when, and a watch task on the event loop
    cancels the lane call once one has run ``timeout_s``. The lane call is then
    abandoned after its grace (its thread stays stuck in the user's call) and
    :meth:`run` raises :class:`DeadlineError` naming that call: "<what> did not finish
    within <timeout_s> s (<setting>)". Use one per :meth:`run` (it records the overrun).
    """

    def __init__(self, timeout_s: float, setting: str, describe: Callable[[Any], str]) -> None:
        self.timeout_s = timeout_s
        self.setting = setting
        self.describe = describe  # a call's key → "<what>" in the line (only on an overrun)
        self._current: tuple[Any, float] | None = None  # (key, time.monotonic() at start)
        self._overran: str | None = None

    def call(self, key: Any, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)``, watched (on the lane's thread, inside :meth:`run`); ``key``
        names the call should it overrun (through ``describe``)."""
        self._current = (key, time.monotonic())
        try:
            return fn(*args)
        finally:
            self._current = None

    async def run(
        self, run: Callable[[Callable[[], T]], Awaitable[T]] | None, work: Callable[[], T]
    ) -> T:
        """``await run(work)`` with every :meth:`call` inside it watched; ``run`` None
        calls ``work`` here, on the event loop, where nothing can cut it."""
        if run is None:
            return work()
        result: T | None = None
        with abandoning(min(self.timeout_s, ABANDON_GRACE_S)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, tg.cancel_scope)
                result = await run(work)
                tg.cancel_scope.cancel()  # the watch
        if self._overran is not None:
            raise overran(self._overran, self.timeout_s, self.setting)
        return result  # type: ignore[return-value]  # set unless cancelled, and then raised

    async def _watch(self, scope: anyio.CancelScope) -> None:
        while True:
            current = self._current
            if current is None:  # queued behind another call, or between two
                await anyio.sleep(_POLL_S)
                continue
            left = current[1] + self.timeout_s - time.monotonic()
            if left > 0:
                await anyio.sleep(left)
            elif self._current is current:
                self._overran = self.describe(current[0])
                scope.cancel()
                return
