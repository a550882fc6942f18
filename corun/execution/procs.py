"""Child processes (rollout engines, servers) that never outlive the run.

Each child starts in its own session and process group, so stopping it stops
everything it spawned (the session's members that left the group too). ``stop`` is
bounded: SIGTERM to the group, then SIGKILL after a grace period. Every live group
is also killed by the CLI's hard-deadline exit. A child's ``workdir`` goes with it.

:meth:`ChildProcess.python_module` also covers this process dying by SIGKILL, which
leaves it no chance to stop anything: the child runs the module under this file's
``__main__`` (by path: importing the ``corun`` package would load torch into a
long-lived process), whose watch SIGKILLs the child's whole session and removes its
workdir once this process is gone.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_live: dict[int, ChildProcess] = {}
_lock = threading.Lock()
KILLED_WAIT_S = 5.0  # a SIGKILLed child ends at once; waited for, bounded all the same
_PARENT_ENV = "CORUN_PARENT"  # the pid a watched child must not outlive
_WORKDIR_ENV = "CORUN_PARENT_WORKDIR"  # the directory it removes when that pid is gone


class ChildProcess:
    """A subprocess in a new process group, registered until it is stopped."""

    def __init__(
        self, argv: Sequence[str], workdir: str | None = None, **popen_kwargs: object
    ) -> None:
        self.workdir = workdir  # removed once the child is stopped
        self.popen: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            list(argv), start_new_session=True, **popen_kwargs
        )
        with _lock:
            _live[self.popen.pid] = self

    @classmethod
    def python_module(
        cls, module: str, args: Sequence[str], workdir: str | None = None,
        env: dict[str, str] | None = None, python: str = sys.executable,
        **popen_kwargs: object,
    ) -> ChildProcess:  # fmt: skip
        """``python -m module args``, ended with its session even if this process is
        SIGKILLed (see the module docstring); ``python``: another environment's
        interpreter (this file needs only the standard library)."""
        watch = {_PARENT_ENV: str(os.getpid()), _WORKDIR_ENV: workdir or ""}
        argv = [python, os.path.abspath(__file__), module, *args]
        return cls(argv, workdir, env={**(env or os.environ), **watch}, **popen_kwargs)

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
            return self.popen.wait(timeout=KILLED_WAIT_S)
        finally:
            with _lock:
                _live.pop(self.popen.pid, None)
            if self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)


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
    return [pid for pid, _, _, session in _processes() if session == sid and pid != sid]


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie does not: it is dead,
    and an orphan's reaping is init's (which may take a second in a container)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the id is someone else's
        return False
    return any(group == pgid and state != b"Z" for _, state, group, _ in _processes())


def _processes() -> list[tuple[int, bytes, int, int]]:
    """(pid, state, process group, session) of every process (Linux /proc; none found
    elsewhere)."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                # pid (comm) state ppid pgrp session: comm may hold spaces and parens.
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        found.append((int(entry.name), fields[0], int(fields[2]), int(fields[3])))
    return found


def kill_all() -> None:
    """SIGKILL every live child group (the last resort of a hard exit)."""
    with _lock:
        children = list(_live.values())
    for child in children:
        _signal_group(child.pid, signal.SIGKILL)
    for child in children:
        if child.workdir:
            shutil.rmtree(child.workdir, ignore_errors=True)


def _end_with_parent(parent: int, workdir: str) -> None:
    """Once ``parent`` is gone, SIGKILL this session (the members in other groups first:
    this process goes with its own group, last) and remove ``workdir``."""
    while os.getppid() == parent:
        time.sleep(0.2)
    for _ in range(3):  # one forked meanwhile is caught by the next pass
        for member in _session_members(os.getsid(0)):
            try:
                os.kill(member, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watched_main(argv: list[str]) -> None:
    """``python procs.py MODULE ARGS``: run MODULE as ``__main__`` under the watch above."""
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # corun/ is no place for top-level modules (corun/trace.py: `trace`)
    parent = int(os.environ.pop(_PARENT_ENV))
    workdir = os.environ.pop(_WORKDIR_ENV, "")
    threading.Thread(target=_end_with_parent, args=(parent, workdir), daemon=True).start()
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _watched_main(sys.argv[1:])


def last_line(log: Path) -> str:
    """A child's log's last non-blank line, for the one line that says why it ended."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(nothing logged)"


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a child to bind)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
