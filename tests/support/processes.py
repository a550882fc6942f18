"""Child processes as the tests see them: the ``corun`` command and its environment,
liveness and descendants from /proc, the events.jsonl a running process writes, and
``wait_until``, the one polling loop behind every "wait until it is gone/there"."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def corun_command() -> list[str]:
    """The installed ``corun`` script, or ``python -m corun`` (the same entry point)."""
    script = Path(sys.executable).with_name("corun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "corun"]


def environment() -> dict[str, str]:
    """This environment, with the repository importable (``tests.support.*`` kinds) and
    wandb off."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled"}


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    *,
    poll_s: float = 0.05,
    unless: Callable[[], bool] = lambda: False,
) -> T:
    """Call ``predicate`` every ``poll_s`` seconds until it returns something truthy, and
    return that; or its falsy value once ``timeout_s`` has passed or ``unless()`` holds
    (the process that would make it true has exited). The caller asserts, with its
    own message."""
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if unless() or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid was reused by someone else's process
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def group_alive(pgid: int) -> bool:
    """Whether any process (zombies included) is left in the process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [child for child, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s events.jsonl so far (a line being written by a
    running process may be incomplete: left out)."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines = lines[:-1]
    return [msgspec.json.decode(line) for line in lines if line.strip()]


def processes_with(entry: bytes) -> list[int]:
    """Live processes whose environment holds ``entry`` (children inherit it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def dump_stacks(pid: int) -> None:
    """SIGUSR1 to ``pid`` and its descendants that run ``corun train`` (the launcher,
    torchrun's agent, the ranks): each prints its threads' stacks to stderr and goes on
    (corun/host/early_signals.py), for the message of a test that found it hanging."""
    for each in [pid, *children_of(pid)]:
        try:
            if b"corun\0train\0" in Path(f"/proc/{each}/cmdline").read_bytes():
                os.kill(each, signal.SIGUSR1)
        except (OSError, ProcessLookupError):  # gone meanwhile
            pass
    time.sleep(2.0)  # the dumps reach the stderr file
