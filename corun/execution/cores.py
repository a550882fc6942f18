"""How many torch threads a lane's calls use, and the machine's free cores.

A lane with ``loop.lane_threads = 0`` (the default) uses the machine's cores divided
among the run's lanes that may compute side by side, fixed for the run: the thread
count changes float rounding, so a count that followed the machine's load would make
the same seed give other weights on a busy machine. torch's OpenMP threads spin at
barriers, and beside a busy process a spinning team waits at every op for its
descheduled member (an SFT step 3x slower on 2 cores); corun makes them sleep instead
(``OMP_WAIT_POLICY=PASSIVE``, set when corun is imported before torch: corun/__init__.py).
``loop.adapt_threads`` trades reproducibility for the old behaviour: the cores other
processes leave free, re-read from ``/proc/stat`` at most four times a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corun.base.config import Config

SAMPLE_INTERVAL_S = 0.25  # how often the free cores are re-read
HYSTERESIS = 0.6  # cores of others' work past the current estimate before it moves


def machine_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read_ticks() -> tuple[int, int] | None:
    """(busy ticks of all CPUs, ticks of this process) since boot; None off Linux."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = stat.readline().split()[1:]
        with open("/proc/self/stat", "rb") as own:
            after_name = own.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are
    # busy (steal: another guest on the host had the core).
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
    return busy, int(after_name[11]) + int(after_name[12])  # utime + stime


class FreeCores:
    """The cores not busy with other processes' work, sampled at most every
    ``SAMPLE_INTERVAL_S`` (the first answer, before two samples exist, is all of them)."""

    def __init__(self) -> None:
        self.cores = machine_cores()
        self._all_cores = max(self.cores, os.cpu_count() or 1)  # /proc/stat counts them all
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._lock = threading.Lock()
        self._last: tuple[float, int, int] | None = None
        self._others = 0  # cores' worth of other processes' work, as currently judged
        self._next = 0.0
        self.clock = time.monotonic

    def prime(self) -> None:
        """Take the first sample now (if none yet), so the first call that comes
        ``SAMPLE_INTERVAL_S`` later already knows the machine's load."""
        if self._last is None:
            self()

    def __call__(self) -> int:
        now = self.clock()
        if now >= self._next and self._lock.acquire(blocking=False):
            try:
                self._sample(now)
            finally:
                self._lock.release()
        return max(1, min(self.cores, self._all_cores - self._others))

    def _sample(self, now: float) -> None:
        self._next = now + SAMPLE_INTERVAL_S
        ticks = _read_ticks()
        if ticks is None:
            return
        if self._last is not None and now > self._last[0]:
            elapsed = (now - self._last[0]) * self._ticks_per_s
            others = ((ticks[0] - self._last[1]) - (ticks[1] - self._last[2])) / elapsed
            if abs(others - self._others) > HYSTERESIS:
                self._others = max(0, int(others + 0.5))
        self._last = (now, *ticks)


_free = FreeCores()


def free_cores() -> int:
    """The cores not busy with other processes' work (this process's estimate)."""
    return _free()


class ThreadBudget:
    """Torch intra-op threads for one lane whose ``lane_threads`` is 0: the machine's
    cores (capped by the process's own setting when the lane was made) divided by
    ``share``, the number of the run's lanes that may compute side by side — chosen
    once, when the lane is made, so that float rounding, and with it the weights a seed
    gives, never depends on what else runs on the machine. With ``adapt`` the count
    follows the cores other processes leave free instead, re-read before each call:
    faster beside busy processes without passive waiting, at the price of that
    reproducibility."""

    def __init__(self, share: int = 1, adapt: bool = False) -> None:
        torch = sys.modules.get("torch")
        self.cap = torch.get_num_threads() if torch is not None else machine_cores()
        self.share = max(1, share)
        self.adapt = adapt
        self.fixed = max(1, min(self.cap, machine_cores()) // self.share)
        if adapt:
            _free.prime()
        self.current = 0  # threads set on the lane's thread
        self._thread = 0

    def start_call(self) -> None:
        """Before a call on the lane's thread: set the thread's torch threads to the
        budget (if torch is in use)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        thread = threading.get_ident()
        if thread != self._thread:  # the lane's first call, or a fresh thread
            # torch sets a thread's count from its process-wide one at the thread's
            # first use; done first here, so that it cannot undo the count set below.
            torch.get_num_threads()
            self._thread, self.current = thread, 0
        threads = self.fixed
        if self.adapt:
            threads = max(1, min(self.cap, free_cores()) // self.share)
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads


def side_by_side(config: Config) -> int:
    """How many of a run's lanes may compute at once: the train lane, each rollout
    worker's above concurrency 1, and the policy endpoint's."""
    loop = config.loop
    return 1 + (loop.workers if loop.concurrency > 1 else 0) + int(config.serve.enabled)
