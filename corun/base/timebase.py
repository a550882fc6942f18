"""The run's time base: what the loop's timings (``perf/*`` metrics, idle ratios, event
times, trace spans) are measured on.

Real time (``time.monotonic``, ``time.time``) unless a virtual clock is installed for
the current context, as ``corun simulate`` does (corun/sim/simulate.py): the same template
then runs on trio's mock clock, and every timing it records is virtual. A context
variable, so tasks and the lanes' worker threads started inside see it, and a real
run beside a simulation (tests) keeps real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_virtual: ContextVar[Callable[[], float] | None] = ContextVar("corun_virtual_time", default=None)


def monotonic() -> float:
    """Seconds on a monotonic clock: real, or the virtual clock's time."""
    now = _virtual.get()
    return time.monotonic() if now is None else now()


def wall() -> float:
    """Seconds since the epoch (event times, trace spans); under a virtual clock, its
    time (a run simulated from 0)."""
    now = _virtual.get()
    return time.time() if now is None else now()


def is_virtual() -> bool:
    return _virtual.get() is not None


@contextmanager
def virtual(now: Callable[[], float]) -> Iterator[None]:
    """Measure time with ``now`` (seconds) in this context, until the block ends."""
    token = _virtual.set(now)
    try:
        yield
    finally:
        _virtual.reset(token)
