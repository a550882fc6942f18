"""Plumbing for the interrupt storm (tests/support/storm.py) and the kill-during-save test:
``corun train`` subprocesses started as a terminal's foreground job, every process of
theirs found from /proc, and their run directories' records and checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corun.records import checkpoint
from tests.support.processes import REPO, environment, wait_until

POLL_S = 0.05


def _foreground() -> None:
    """In the child, before exec: what a terminal's foreground job starts with."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass(frozen=True)
class Proc:
    state: str
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks since boot: a reused pid has another


def proc_table() -> dict[int, Proc]:
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            table[int(entry.name)] = Proc(
                fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
            )
    return table


class Watch:
    """Every process of a run: its group and its descendants, seen by polling /proc."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, Proc] = {}

    def poll(self) -> None:
        table = proc_table()
        mine = {self.root, *self.seen}
        grew = True
        while grew:
            kids = {
                pid
                for pid, p in table.items()
                if pid not in mine and (p.ppid in mine or p.pgid == self.root)
            }
            grew = bool(kids)
            mine |= kids
        for pid in mine - {self.root} - self.seen.keys():
            if pid in table:
                self.seen[pid] = table[pid]

    def left(self) -> list[str]:
        """Live processes (not zombies) of the group, seen, or in a session one opened."""
        table = proc_table()
        own_sid = os.getsid(0)
        sessions = {p.sid for p in self.seen.values()} - {own_sid}
        found = []
        for pid, p in table.items():
            if p.state == "Z":
                continue
            was = self.seen.get(pid)
            if p.pgid == self.root or p.sid in sessions or (was and was.start == p.start):
                found.append(f"{pid} ({_cmdline(pid)})")
        return found

    def wait_gone(self, timeout_s: float = 5.0) -> list[str]:
        """What is still left after up to ``timeout_s`` (nothing, once all are gone)."""
        wait_until(lambda: not self.left(), timeout_s, poll_s=POLL_S)
        return self.left()

    def kill(self) -> None:
        """SIGKILL whatever is left (the group, then each process seen alive)."""
        try:
            os.killpg(self.root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        table = proc_table()
        for pid, was in self.seen.items():
            now = table.get(pid)
            if now is not None and now.start == was.start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:80]


@dataclass
class Child:
    """A ``corun`` subprocess with its output files and process watch."""

    proc: subprocess.Popen[bytes]
    watch: Watch
    out: Path
    launched: float  # time.time() at launch, to place event times
    files: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, command: list[str], out: Path) -> Child:
        out.mkdir(parents=True, exist_ok=True)
        stdout = open(out / "stdout.txt", "wb")
        stderr = open(out / "stderr.txt", "wb")
        launched = time.time()
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=environment(),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            process_group=0,
            preexec_fn=_foreground,
        )
        return cls(proc, Watch(proc.pid), out, launched, [stdout, stderr])

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stderr_bytes(self) -> bytes:
        return (self.out / "stderr.txt").read_bytes()

    def stderr(self) -> str:
        return self.stderr_bytes().decode(errors="replace")

    def stderr_size(self) -> int:
        return (self.out / "stderr.txt").stat().st_size

    def sleep(self, seconds: float) -> None:
        """Sleep, polling the process table, until ``seconds`` pass or the process ends."""
        self.sleep_until(lambda: False, seconds)

    def sleep_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Poll the process table until ``done()``, ``timeout_s`` or the process's end."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and (now := time.monotonic()) < deadline:
            self.watch.poll()
            if done():
                return
            time.sleep(min(POLL_S, deadline - now))

    def wait(self, timeout_s: float) -> int | None:
        self.sleep(timeout_s)
        return self.proc.poll()

    def close(self) -> None:
        """Kill whatever is left (the group, every descendant seen); close the files."""
        if self.proc.poll() is None:
            self.watch.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.watch.kill()
        for f in self.files:
            f.close()


# ----------------------------------------------------------------------------- records


def last_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest run in an events.jsonl (a resume appends)."""
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    return records[starts[-1] :] if starts else []


def final_state(run_dir: Path, steps: int) -> tuple[dict[str, Any], Any]:
    state, tensors = checkpoint.read(checkpoint.step_dir(run_dir, steps))
    fields = {k: getattr(state, k) for k in ("step", "version", "data_cursor", "trained_ahead")}
    return fields, tensors


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where two checkpoint trees differ (bitwise), or None."""
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )  # fmt: skip
        return None if same else where or "/"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where or '/'} (keys)"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return f"{where or '/'} (length)"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{where}/{i}")
            if found:
                return found
        return None
    return None if a == b else where or "/"
