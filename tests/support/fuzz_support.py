"""Shared by the fuzz tests (tests/test_fuzz_*.py): one reproducible hypothesis
profile, example counts per input kind (printed in pytest's terminal summary by
tests/conftest.py), a hang guard for in-process loaders, and run-directory hashes."""

from __future__ import annotations

import hashlib
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.support.processes import corun_command, environment

# Derandomized and database-less: CI draws the same examples on every run.
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

# Any JSON value (no NaN: JSON has none), a few levels deep.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)

# Examples run per input kind, e.g. {"config/toml": 150, ...}.
COUNTS: Counter[str] = Counter()


def count(kind: str) -> None:
    COUNTS[kind] += 1


class Hang(Exception):
    pass


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``:
    a SIGALRM in the main thread, which is where pytest runs a synchronous test."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_one_line(message: str, *places: str) -> None:
    """A usage error's message: one non-empty line naming every one of ``places``."""
    assert message.strip(), "empty error message"
    assert len(message.splitlines()) == 1, f"not one line: {message!r}"
    assert "Traceback" not in message, message
    for place in places:
        assert place in message, f"{place!r} not named in: {message}"


def tree_hash(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with a hash of its bytes ("dir" for folders)."""
    if not root.exists():
        return {}
    out = {}
    for path in sorted([root, *root.rglob("*")]):
        key = str(path.relative_to(root))
        out[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def corun_many(cwd: Path, *argvs: list[str], timeout: float = 120) -> list[tuple[int, str, str]]:
    """``corun <argv>`` for each argv, all at once (each starts by importing torch, so
    side by side they take about half as long on two cores): (status, stdout, stderr)."""
    procs = [
        subprocess.Popen(
            [*corun_command(), *argv],
            cwd=cwd,
            env=environment(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(killed: no exit within {timeout} s)"
        results.append((proc.returncode, out, err))
    return results
