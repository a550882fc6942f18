"""Running ``corun train`` as a real subprocess for the signal tests: start it on a
config built from tables, wait for a trainer phase marker or an event, send signals,
and check what the teardown contract promises (exit status, teardown order, the
latest checkpoint, no leftover engine process, no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import tomli_w

from corun.records import checkpoint
from tests.fakes import DOCUMENTED_ORDER, TEARDOWN_ORDER

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # deadline for a phase marker or an event to appear
EXIT_S = 30.0  # deadline for the process to exit after the (last) signal

# Registered before the trainer's setup runs, so present even when it is interrupted.
ALWAYS = ["teardown:stop", "teardown:logging", "teardown:on_train_end"]
EXIT_CODE = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _corun_command() -> list[str]:
    script = Path(sys.executable).with_name("corun")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "corun.host.cli"]


def _alive(pid: int) -> bool:
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


@dataclass
class CorunRun:
    """One ``corun train`` subprocess and its run directory."""

    proc: subprocess.Popen[bytes]
    tmp: Path
    run_dir: Path
    engine_pid: int | None = None
    _files: list[Any] = field(default_factory=list)

    # -- what it wrote
    def stdout(self) -> str:
        path = self.tmp / "stdout.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def stderr(self) -> str:
        path = self.tmp / "stderr.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        # A line being written may be incomplete while the process runs.
        lines = path.read_bytes().splitlines(keepends=True)
        if lines and not lines[-1].endswith(b"\n"):
            lines = lines[:-1]
        return [msgspec.json.decode(line) for line in lines if line.strip()]

    def names(self) -> list[str]:
        return [record["event"] for record in self.events()]

    # -- synchronisation
    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"corun exited ({self.proc.returncode}) before {what}:\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s:\n{self.stderr()}")
            time.sleep(0.02)

    def wait_phase(self, phase: str) -> None:
        marker = self.run_dir / f"phase-{phase}"
        self.wait_until(f"phase marker {marker.name}", marker.exists)

    def wait_event(self, event: str) -> None:
        self.wait_until(f"event {event!r}", lambda: event in self.names())

    def wait_stderr(self, text: str) -> None:
        self.wait_until(f"{text!r} on stderr", lambda: text in self.stderr())

    def send(self, sig: signal.Signals) -> None:
        self.engine_pid_now()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = EXIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"corun still running {timeout} s after the signal:\n{self.stderr()}")

    def engine_pid_now(self) -> int | None:
        if self.engine_pid is None and (self.run_dir / "engine.pid").exists():
            self.engine_pid = int((self.run_dir / "engine.pid").read_text())
        return self.engine_pid


@pytest.fixture
def start_corun(tmp_path: Path) -> Iterator[Callable[..., CorunRun]]:
    """Start ``corun train`` on a config built from tables; clean up whatever is left."""
    runs: list[CorunRun] = []

    def start(
        trainer: dict[str, Any],
        overrides: tuple[str, ...] = (),
        command: str = "train",
        **tables: dict[str, Any],
    ) -> CorunRun:
        run_dir = tmp_path / "run"
        config = {
            "run": {"dir": str(run_dir), "steps": 3, **tables.pop("run", {})},
            "log": {"progress": "plain", **tables.pop("log", {})},
            # The fake trainer with its engine child process, unless another kind is named.
            "trainer": trainer
            if "kind" in trainer
            else {"kind": "tests.fakes:FakeTrainer", "spawn_engine": True, **trainer},
            **tables,
        }
        cfg = tmp_path / "cfg.toml"
        cfg.write_text(tomli_w.dumps(config))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
            "WANDB_MODE": "disabled",
        }
        stdout = open(tmp_path / "stdout.txt", "wb")
        stderr = open(tmp_path / "stderr.txt", "wb")
        proc = subprocess.Popen(
            [*_corun_command(), command, str(cfg), *overrides],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )
        run = CorunRun(proc, tmp_path, run_dir, _files=[stdout, stderr])
        runs.append(run)
        return run

    yield start

    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        pid = run.engine_pid_now()
        if pid is not None and _alive(pid):  # a leaked engine: do not let it linger
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in run._files:
            f.close()


# ----------------------------------------------------------------------------- checks


def assert_teardown_order(names: list[str], *, complete: bool) -> None:
    teardown = [n for n in names if n.startswith("teardown:")]
    assert len(teardown) == len(set(teardown)), f"a teardown step ran twice: {teardown}"
    unknown = [n for n in teardown if n not in DOCUMENTED_ORDER]
    assert not unknown, f"unexpected teardown steps {unknown}"
    expected = [n for n in DOCUMENTED_ORDER if n in teardown]
    assert teardown == expected, f"teardown order {teardown}, documented {DOCUMENTED_ORDER}"
    required = TEARDOWN_ORDER if complete else ALWAYS
    missing = [n for n in required if n not in teardown]
    assert not missing, f"teardown steps missing: {missing} (ran {teardown})"
    # `end` comes after every teardown step, and nothing follows it.
    assert names[-1] == "end", f"last event is {names[-1]!r}, not 'end'"
    assert names.count("end") == 1
    assert names.index("teardown:stop") < names.index("teardown:on_train_end")


def assert_engine_gone(run: CorunRun) -> None:
    pid = run.engine_pid_now()
    assert pid is not None, "the fake engine never wrote engine.pid"
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid), f"engine child {pid} outlived `corun train`"


def assert_latest_checkpoint_loads(run: CorunRun, *, expect_step: int | None) -> None:
    latest = checkpoint.latest(run.run_dir)
    if expect_step is None:
        if latest is not None:  # whatever was written must load
            checkpoint.read(latest)
        return
    assert latest is not None, "expected a checkpoint, found none"
    state, tensors = checkpoint.read(latest)
    assert state.step == expect_step
    assert "model" in tensors["trainer"]
    assert not list(checkpoint.checkpoints_dir(run.run_dir).glob(".tmp-*"))


def assert_interrupted(
    run: CorunRun, code: int, sig: signal.Signals, *, complete: bool = True
) -> list[dict[str, Any]]:
    stderr = run.stderr()
    assert code == EXIT_CODE[sig], f"exit status {code}, expected {EXIT_CODE[sig]}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    events = run.events()
    names = [e["event"] for e in events]
    assert events, "events.jsonl is empty"
    end = events[-1]
    assert end["event"] == "end", f"last event {end}"
    assert end["reason"] == "interrupted", end
    assert end.get("signal") == sig.name, end
    assert_teardown_order(names, complete=complete)
    bad = [e for e in events if e["event"].startswith("teardown:") and e["status"] == "error"]
    assert not bad, f"teardown steps failed: {bad}"
    return events
