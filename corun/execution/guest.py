"""A run is a guest in its host's process: what it does to the GIL and the garbage
collector, both process-wide, the host's event loop feels.

corun trains inside the caller's event loop (an embedding service's, or the CLI's) and
runs its compute on lane threads, so the loop thread never runs a step; but it needs
the GIL each time it wakes, and two CPython mechanisms decide how long a lane thread
can keep it waiting. benchmarks/host_lag.py measures both (a 1 ms ticker in the host
while the sft recipe trains, 2 CPU cores): with these settings the ticker's p99 lag
went from 3.6–3.9 to 1.3–2.3 ms and its max from 106–129 to 6–15 ms, at no measurable
cost in steps per second.

- **The switch interval** (``sys.setswitchinterval``, 5 ms by default): a thread that
  wants the GIL waits up to that long before its holder is made to drop it. Set-up runs
  Python on the lane for about a second (AdamW's first construction imports
  ``torch._dynamo``: some 850 modules), and each wake-up of the loop waited up to 5 ms
  meanwhile. While any run is active the interval is at most 1 ms.
- **Full collections** hold the GIL throughout: ~70 ms with torch imported, ~125 ms once
  ``torch._dynamo`` is, and the ~220k objects set-up creates triggered two of them.
  Set-up runs with the collector paused, and then everything alive is frozen
  (``gc.freeze``: modules, model, optimizer), so the run's full collections skip it
  (~0 ms instead of ~125). Frozen objects are never collected, cyclic garbage included,
  so the last run to end unfreezes them again. A host that froze objects itself keeps
  its freeze: corun then freezes (and unfreezes) nothing.

Both are process-wide, so they are held while *any* run needs them (runs nest, as
prerequisites do, and a host may run several) and undone when the last one ends.

The ``corun`` command's process ends with its outermost run (:func:`set_process_ends_with_runs`):
a teardown there need not hand memory back, which the exit does at once. A library's
shutdown that collects the whole heap to free memory (vLLM's runs two full collections:
1.3 s of a 1.5 s Ctrl-C on 2 cores) runs under :func:`collections_left_to_exit`, which
then skips its ``gc.collect()`` calls. In a host's process, or for a nested
(prerequisite) run, they run as before.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH_INTERVAL_S = 0.001


class _Guest:
    """The process-wide settings, and how many runs and set-ups hold them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a host may run corun on more than one loop thread
        self._runs = 0
        self._setups = 0
        self._switch_interval_s = 0.0  # the host's, restored when the last run ends
        self._collector_was_enabled = False
        self._froze = False  # corun froze the collector's objects (and will unfreeze)
        self.ends_with_runs = False  # the process exits when its runs end (the CLI)

    @property
    def runs(self) -> int:
        return self._runs

    @contextmanager
    def running(self) -> Iterator[None]:
        """For a run's whole life: the loop thread waits at most ~1 ms for the GIL."""
        with self._lock:
            if self._runs == 0:
                self._switch_interval_s = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch_interval_s, SWITCH_INTERVAL_S))
            self._runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._runs -= 1
                if self._runs == 0:
                    sys.setswitchinterval(self._switch_interval_s)
                    if self._froze:
                        gc.unfreeze()  # collectable again, by the host's next full collection
                        self._froze = False

    @contextmanager
    def setting_up(self) -> Iterator[None]:
        """Around a trainer's set-up (inside :meth:`running`): no full collections of
        what it imports and builds, which is frozen when the last set-up ends."""
        with self._lock:
            if self._setups == 0:
                self._collector_was_enabled = gc.isenabled()
                gc.disable()
            self._setups += 1
        try:
            yield
        finally:
            with self._lock:
                self._setups -= 1
                if self._setups == 0:
                    if self._froze or gc.get_freeze_count() == 0:  # not over a host's freeze
                        gc.freeze()
                        self._froze = True
                    if self._collector_was_enabled:
                        gc.enable()


_guest = _Guest()
running = _guest.running
setting_up = _guest.setting_up


def set_process_ends_with_runs() -> None:
    """The ``corun`` command: this process exits when its runs end."""
    _guest.ends_with_runs = True


def process_ends_with_runs() -> bool:
    """Whether this process exits when its runs end (the ``corun`` command): what a
    run leaves behind (a thread, memory) the exit ends."""
    return _guest.ends_with_runs


@contextmanager
def collections_left_to_exit() -> Iterator[None]:
    """Around a library's shutdown: when the process exits once the run being torn down
    ends (the ``corun`` command's outermost run), its ``gc.collect()`` calls are skipped."""
    if not (_guest.ends_with_runs and _guest.runs <= 1):
        yield
        return
    collect = gc.collect
    gc.collect = _no_collection  # process-wide; the CLI's process has no host to notice
    try:
        yield
    finally:
        gc.collect = collect


def _no_collection(generation: int = 2) -> int:
    return 0
