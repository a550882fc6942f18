"""``corun``'s command line, in process (``corun.host.cli.main``) and as a subprocess: a
minimal config file for the fake trainer, the call with its exit status and output,
the one-line usage error it must print, the fixture that undoes what ``main`` sets
process-wide, and a listing to check that a refused run left its directory alone."""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from corun.host import cli
from tests.support.processes import corun_command, environment

FAKE = "tests.support.fakes:FakeTrainer"


def base_toml(run_dir: Path, extra: str = "") -> str:
    return (
        f'[run]\ndir = "{run_dir}"\nsteps = 2\n\n'
        '[log]\nprogress = "off"\n\n'
        f'[trainer]\nkind = "{FAKE}"\n' + extra
    )


@pytest.fixture
def restore_process_state() -> Iterator[None]:
    """``cli.main`` installs signal handlers and may configure logging: undo both.
    (A test module that calls ``main`` uses it for every test: ``pytestmark``.)"""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    root.handlers[:] = root_handlers
    root.setLevel(root_level)


def call_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, *places: str) -> str:
    assert "Traceback" not in err, err
    assert code == 2, f"exit status {code}:\n{err}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("corun: error: "), line
    assert line.strip() != "corun: error:", line
    for place in places:
        assert place in line, f"{place!r} not named in: {line}"
    return line


def corun_subprocess(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``corun <args>`` in ``tmp_path``, to its end (2 minutes at most)."""
    return subprocess.run(
        [*corun_command(), *args],
        cwd=tmp_path,
        env=environment(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def listing(root: Path) -> list[tuple[str, bool, int, int]]:
    """Every path under ``root`` (and ``root`` itself) with kind, size and mtime."""
    entries = [root, *root.rglob("*")]
    return sorted(
        (
            str(p.relative_to(root)),
            p.is_dir(),
            0 if p.is_dir() else p.stat().st_size,
            p.stat().st_mtime_ns,
        )
        for p in entries
    )
