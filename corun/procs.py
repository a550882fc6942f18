"""Child processes (rollout engines, servers) that never outlive the run.

Each child starts in its own process group, so stopping it stops everything it
spawned. ``stop`` is bounded: SIGTERM to the group, then SIGKILL after a grace
period. Every live group is also killed by the CLI's hard-deadline exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

_live: dict[int, subprocess.Popen[bytes]] = {}
_lock = threading.Lock()


class ChildProcess:
    """A subprocess in a new process group, registered until it is stopped."""

    def __init__(self, argv: Sequence[str], **popen_kwargs: object) -> None:
        self.popen: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            list(argv), start_new_session=True, **popen_kwargs
        )
        with _lock:
            _live[self.popen.pid] = self.popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; blocking, bounded."""
        try:
            _signal_group(self.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            _signal_group(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(timeout=grace_s)
        finally:
            with _lock:
                _live.pop(self.popen.pid, None)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> None:
    """SIGKILL every live child group (the last resort of a hard exit)."""
    with _lock:
        pids = list(_live)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
