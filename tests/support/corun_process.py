"""Running ``corun train`` as a real subprocess for the signal tests: start it on a
config built from tables, wait for a trainer phase marker or an event, send signals,
and check what the teardown contract promises (exit status, teardown order, the
latest checkpoint, no leftover engine process, no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from corun.records import checkpoint
from tests.support.fakes import DOCUMENTED_ORDER, TEARDOWN_ORDER
from tests.support.processes import (
    alive,
    corun_command,
    dump_stacks,
    environment,
    events,
    wait_until,
)

WAIT_S = 60.0  # deadline for a phase marker or an event to appear
EXIT_S = 30.0  # deadline for the process to exit after the (last) signal

# Registered before the trainer's setup runs, so present even when it is interrupted.
ALWAYS = ["teardown:stop", "teardown:logging", "teardown:on_train_end"]
EXIT_CODE = {signal.SIGINT: 130, signal.SIGTERM: 143}


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
        return events(self.run_dir)

    def names(self) -> list[str]:
        return [record["event"] for record in self.events()]

    # -- synchronisation
    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        if wait_until(predicate, timeout, poll_s=0.02, unless=self.exited):
            return
        if self.exited():
            pytest.fail(f"corun exited ({self.proc.returncode}) before {what}:\n{self.stderr()}")
        pytest.fail(f"no {what} within {timeout} s:\n{self.stderr()}")

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_phase(self, phase: str, timeout: float = WAIT_S) -> None:
        marker = self.run_dir / f"phase-{phase}"
        self.wait_until(f"phase marker {marker.name}", marker.exists, timeout)

    def wait_event(self, event: str, timeout: float = WAIT_S) -> None:
        self.wait_until(f"event {event!r}", lambda: event in self.names(), timeout)

    def wait_stderr(self, text: str) -> None:
        self.wait_until(f"{text!r} on stderr", lambda: text in self.stderr())

    def send(self, sig: signal.Signals) -> None:
        self.engine_pid_now()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = EXIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks(self.proc.pid)  # where it hangs, in the message
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
            else {"kind": "tests.support.fakes:FakeTrainer", "spawn_engine": True, **trainer},
            **tables,
        }
        cfg = tmp_path / "cfg.toml"
        cfg.write_text(tomli_w.dumps(config))
        stdout = open(tmp_path / "stdout.txt", "wb")
        stderr = open(tmp_path / "stderr.txt", "wb")
        proc = subprocess.Popen(
            [*corun_command(), command, str(cfg), *overrides],
            cwd=tmp_path,
            env=environment(),
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
        if pid is not None and alive(pid):  # a leaked engine: do not let it linger
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
    gone = wait_until(lambda: not alive(pid), 5.0, poll_s=0.02)
    assert gone, f"engine child {pid} outlived `corun train`"


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
