"""Run-directory records: lifecycle events, metrics and the trace of task spans.

All three are append-only files written line by line, so whatever is on disk after
a crash or a hard kill is still readable: ``events.jsonl`` and ``metrics.jsonl``
hold one JSON object per line; ``trace.json`` uses the Chrome trace "JSON array"
format, whose closing bracket is optional, and opens in Perfetto.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from io import FileIO
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from corun.base import timebase

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.json"

_encoder = msgspec.json.Encoder()


class _LineFile:
    """An append-only JSON-lines file, safe to write from several threads.

    Unbuffered: each line is one ``write(2)``, so it is in the OS's hands (and survives
    a hard kill) as soon as it is written, without a buffer's extra copy and flush."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: FileIO | None = FileIO(path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        line = _encoder.encode(record) + b"\n"
        with self._lock:
            if self._file is not None:
                written = self._file.write(line) or 0
                while written < len(line):  # a short write (rare: a full disk raises)
                    written += self._file.write(line[written:]) or 0

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


class EventLog(_LineFile):
    """``events.jsonl``: one record per lifecycle event, with ``event``, ``step``, ``t``."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir / EVENTS_FILE)

    def emit(self, event: str, step: int, **fields: Any) -> None:
        self.write({"event": event, "step": step, "t": round(timebase.wall(), 6), **fields})


class MetricsLog(_LineFile):
    """``metrics.jsonl``: one record per log call, with its ``step`` axis."""

    def __init__(self, run_dir: Path, keep_up_to_step: int | None = None) -> None:
        path = run_dir / METRICS_FILE
        if keep_up_to_step is not None and path.exists():
            _truncate_after(path, keep_up_to_step)
        super().__init__(path)

    def log(self, step: int, metrics: Mapping[str, float | str]) -> None:
        self.write({"step": step, **metrics})


def _truncate_after(path: Path, step: int) -> None:
    """Drop records past ``step`` (written after the checkpoint a run resumes from)."""
    kept = []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError:
            continue  # a line cut short by a hard kill
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)


class Trace:
    """Chrome-trace spans (``ph: X``), one track per task, written as they close.

    The file is valid JSON after a clean close (it ends with ``]``); after a crash it
    still opens, since the trace viewers accept an array left open. A resumed run
    reopens the array and appends.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / TRACE_FILE
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._tracks: dict[str, int] = {}
        self._file: BinaryIO | None = open(self.path, "a+b")  # closed in close()
        self._reopen_array(self._file)

    @staticmethod
    def _reopen_array(f: BinaryIO) -> None:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            f.write(b"[\n")
            return
        f.seek(max(0, size - 2))
        if f.read().rstrip().endswith(b"]"):  # closed cleanly: reopen the array
            f.truncate(size - 2 if size >= 2 else 0)
            f.write(b",\n")

    @contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        start = timebase.wall()
        try:
            yield
        finally:
            self.complete(name, track, start, timebase.wall(), **args)

    def complete(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            if self._file is None:
                return
            tid = self._tracks.get(track) or self._new_track(track)
            self._write({
                "name": name, "ph": "X", "ts": round(start * 1e6, 1),
                "dur": round((end - start) * 1e6, 1), "pid": self._pid, "args": args, "tid": tid,
            })  # fmt: skip

    def _new_track(self, track: str) -> int:
        tid = self._tracks[track] = len(self._tracks) + 1
        self._write({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                     "args": {"name": track}})  # fmt: skip
        return tid

    def _write(self, record: dict[str, Any], last: bool = False) -> None:
        assert self._file is not None
        self._file.write(_encoder.encode(record) + (b"]\n" if last else b",\n"))

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            process_name = {"name": "corun"}
            self._write({"name": "process_name", "ph": "M", "pid": self._pid,
                         "args": process_name}, last=True)  # fmt: skip
            self._file.close()
            self._file = None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Read back a run-directory JSON-lines file: events, metrics (tests, tools)."""
    return [msgspec.json.decode(line) for line in Path(path).read_bytes().splitlines() if line]
