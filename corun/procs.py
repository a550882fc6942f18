"""Child processes (rollout engines, servers) that never outlive the run.

Each child starts in its own session and process group, so stopping it stops
everything it spawned (the session's members that left the group too). ``stop`` is
bounded: SIGTERM to the group, then SIGKILL after a grace period. Every live group
is also killed by the CLI's hard-deadline exit.
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
    """Signal the child's process group, and the processes of its session that moved
    to groups of their own (Ray's workers do)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for member in _session_members(pid):
        try:
            os.kill(member, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` (Linux /proc; none found elsewhere)."""
    members = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                # pid (comm) state ppid pgrp session: comm may hold spaces and parens.
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and int(entry.name) != sid:
            members.append(int(entry.name))
    return members


def kill_all() -> None:
    """SIGKILL every live child group (the last resort of a hard exit)."""
    with _lock:
        pids = list(_live)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
