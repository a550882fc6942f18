"""A refused start leaves its run directory as it was.

The template opens its records (events, metrics, trace) before the trainer's set-up
reads its data and before a checkpoint's tensors are loaded into it, so a usage error
found there (a bad data file, tensors that do not fit) comes after the first writes.
:func:`put_back_on_refusal` notes the directory's files first and, on a usage error
raised before this run trained a step, removes what was added and cuts what grew back
to its old size and bytes (appended records; the trace rewrites only its tail).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from corun.base.errors import UsageError
from corun.execution.compute import ComputeMode, blocking_io


class _Steps(Protocol):
    @property
    def step(self) -> int: ...


class _Clocked(Protocol):
    @property
    def clock(self) -> _Steps: ...


RunT = TypeVar("RunT", bound=_Clocked)
# A file's last bytes, kept to undo a rewrite of its tail (the trace's closing bracket).
_TAIL_BYTES = 64 * 1024


@dataclass
class _File:
    size: int
    tail: bytes


@dataclass
class Guard:
    run_dir: Path
    existed: bool
    dirs: set[Path] = field(default_factory=set)
    files: dict[Path, _File] = field(default_factory=dict)
    clock: _Steps | None = None
    first_step: int = 0

    def watch(self, run: RunT) -> RunT:
        """The run (its clock): once it has trained a step, its records stay."""
        self.clock, self.first_step = run.clock, run.clock.step
        return run

    @property
    def trained(self) -> bool:
        return self.clock is not None and self.clock.step != self.first_step

    def put_back(self) -> None:
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        for path in sorted(self.run_dir.rglob("*"), reverse=True):  # children first
            if path.is_dir() and not path.is_symlink():
                if path not in self.dirs:
                    shutil.rmtree(path, ignore_errors=True)
            elif path not in self.files:
                path.unlink(missing_ok=True)
        for path, before in self.files.items():
            if path.is_file() and path.stat().st_size != before.size:
                with open(path, "r+b") as f:
                    f.truncate(before.size)
                    f.seek(before.size - len(before.tail))
                    f.write(before.tail)


@asynccontextmanager
async def put_back_on_refusal(run_dir: Path, mode: ComputeMode) -> AsyncIterator[Guard]:
    """Note ``run_dir``'s files; on a usage error before a step is trained, put them
    back. The file work runs off the event loop (``mode``: as the run's compute)."""
    guard = await blocking_io(mode, _noted, run_dir)
    try:
        yield guard
    except UsageError:
        if not guard.trained:
            await blocking_io(mode, guard.put_back)
        raise


def _noted(run_dir: Path) -> Guard:
    guard = Guard(run_dir, existed=run_dir.is_dir())
    if guard.existed:
        for path in run_dir.rglob("*"):
            if path.is_dir() and not path.is_symlink():
                guard.dirs.add(path)
            elif path.is_file():
                size = path.stat().st_size
                with open(path, "rb") as f:
                    f.seek(max(0, size - _TAIL_BYTES))
                    guard.files[path] = _File(size, f.read())
    return guard
