"""Run-directory records: lifecycle events, metrics and the trace of task spans.

All three are append-only files written line by line, so whatever is on disk after
a crash or a hard kill is still readable: ``events.jsonl`` and ``metrics.jsonl``
hold one JSON object per line; ``trace.json`` uses the Chrome trace "JSON array"
format, whose closing bracket is optional, and opens in Perfetto.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.json"

_encoder = msgspec.json.Encoder()


class _LineFile:
    """An append-only JSON-lines file, safe to write from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: BinaryIO | None = open(path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        line = _encoder.encode(record) + b"\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


class EventLog(_LineFile):
    """``events.jsonl``: one record per lifecycle event, with ``event``, ``step``, ``t``."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir / EVENTS_FILE)

    def emit(self, event: str, step: int, **fields: Any) -> None:
        self.write({"event": event, "step": step, "t": round(time.time(), 6), **fields})


class MetricsLog(_LineFile):
    """``metrics.jsonl``: one record per log call, with its ``step`` axis."""

    def __init__(self, run_dir: Path, keep_up_to_step: int | None = None) -> None:
        path = run_dir / METRICS_FILE
        if keep_up_to_step is not None and path.exists():
            _truncate_after(path, keep_up_to_step)
        super().__init__(path)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
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
    """Chrome-trace spans (``ph: X``), one track per task, written as they close."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / TRACE_FILE
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file = _LineFile(self.path)
        if fresh:
            with self._file._lock:
                assert self._file._file is not None
                self._file._file.write(b"[\n")
        self._pid = os.getpid()
        self._tracks: dict[str, int] = {}

    @contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.complete(name, track, start, time.time(), **args)

    def complete(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        with self._file._lock:
            if self._file._file is None:
                return
            tid = self._tracks.get(track)
            if tid is None:
                tid = self._tracks[track] = len(self._tracks) + 1
                self._write_locked(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": self._pid,
                        "tid": tid,
                        "args": {"name": track},
                    }
                )
            self._write_locked(
                {
                    "name": name,
                    "ph": "X",
                    "ts": round(start * 1e6, 1),
                    "dur": round((end - start) * 1e6, 1),
                    "pid": self._pid,
                    "tid": tid,
                    "args": args,
                }
            )

    def _write_locked(self, record: dict[str, Any]) -> None:
        assert self._file._file is not None
        self._file._file.write(_encoder.encode(record) + b",\n")

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read back a run-directory JSON-lines file (tests, tools)."""
    return [msgspec.json.decode(line) for line in Path(path).read_bytes().splitlines() if line]
