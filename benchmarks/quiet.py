"""Guarding timings: against other processes' load (measure how busy the rest of the
machine was during a measurement, and repeat a measurement it disturbed), and against
this process's own state (a measurement in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Request = dict[str, Any]  # one measurement: what, steps, backend, compute, run_dir
Measure = Callable[[Request], list[float]]  # a request → step-to-step intervals (s)

# Other processes busier than this (CPUs, on average) make the figures unreliable.
BUSY_CPUS = 0.2
RETRY_PAUSE_S = 5.0


class OtherLoad:
    """CPUs kept busy by other processes, on average, from now until ``stop`` (Linux)."""

    def __init__(self) -> None:
        self._start = time.monotonic(), _busy_cpu_seconds(), _own_cpu_seconds()

    def stop(self) -> float | None:
        wall, busy, own = self._start
        busy_now = _busy_cpu_seconds()
        if busy is None or busy_now is None:
            return None
        others = (busy_now - busy) - (_own_cpu_seconds() - own)
        return round(max(others, 0.0) / max(time.monotonic() - wall, 1e-9), 3)


def _busy_cpu_seconds() -> float | None:
    """Non-idle CPU time of the whole machine, from /proc/stat."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """This process and its waited-for children (the ``--measure`` interpreters)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` starting at the k-th: a different one goes first in each repeat, so none
    always runs in the same slot (as load drifts)."""
    k %= len(items)
    return [*items[k:], *items[:k]]


class Guarded:
    """Repeats a measurement that other processes disturbed; counts what it did."""

    def __init__(self, measure_one: Measure, retries: int) -> None:
        self.measure_one = measure_one
        self.retries = retries
        self.measured = self.retried = self.disturbed = 0

    def __call__(self, request: Request) -> list[float]:
        self.measured += 1
        for attempt in range(self.retries + 1):
            # A fresh run dir each attempt: corun would resume from the last one's checkpoint.
            run_dir = request["run_dir"] if attempt == 0 else f"{request['run_dir']}-{attempt}"
            load = OtherLoad()
            intervals = self.measure_one({**request, "run_dir": run_dir})
            others = load.stop()
            if others is None or others <= BUSY_CPUS:
                return intervals
            if attempt < self.retries:
                self.retried += 1
                time.sleep(RETRY_PAUSE_S)
        self.disturbed += 1
        return intervals


def in_fresh_interpreter(module: str, request: Request, *options: str) -> Any:
    """``python -m benchmarks.<module> [OPTIONS] --measure REQUEST`` in a new interpreter:
    the JSON of its last line of stdout. With a ``tree`` in the request, that checkout's
    module and corun (on PYTHONPATH, for before/after comparisons; a checkout from when the
    suites lived in corun/bench/ has the module there)."""
    env, package, tree = dict(os.environ), "benchmarks", request.get("tree")
    env.update(request.get("env", {}))  # e.g. OMP_WAIT_POLICY, read when torch loads
    if tree is not None:
        env["PYTHONPATH"] = tree
        package = "corun.bench" if (Path(tree) / "corun" / "bench").is_dir() else "benchmarks"
    result = subprocess.run(
        [sys.executable, "-m", f"{package}.{module}", *options, "--measure", json.dumps(request)],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(
            f"measurement {request} failed (exit status {result.returncode}):\n"
            + result.stderr[-3000:]
        )
    return json.loads(result.stdout.splitlines()[-1])
