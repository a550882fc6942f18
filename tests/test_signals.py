"""Real signals to a real ``corun train`` subprocess.

Each test writes a TOML config for the fake trainer (``tests.fakes:FakeTrainer``),
starts ``corun train`` as a subprocess, waits for the trainer's phase marker
(``<run.dir>/phase-<name>``, touched on entering a phase) so the signal lands at a
known moment, sends SIGINT or SIGTERM, and then checks what the contract promises:

- the exit status (130 after SIGINT, 143 after SIGTERM);
- ``events.jsonl`` ends with ``end`` (reason ``interrupted``), and the teardown
  steps that were registered ran once each, in the documented order;
- the latest checkpoint, if any, loads;
- the fake rollout engine (a child process) is gone;
- no traceback on stderr.

Synchronisation is by polling for files and events under a deadline, never by
sleeping a fixed time. Every subprocess imports torch (about 2 s on two cores), so
step counts stay small.
"""

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

from corun import checkpoint
from tests.fakes import TEARDOWN_ORDER

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # deadline for a phase marker or an event to appear
EXIT_S = 30.0  # deadline for the process to exit after the (last) signal

# Registered before the trainer's setup runs, so present even when it is interrupted.
ALWAYS = ["teardown:stop", "teardown:logging", "teardown:on_train_end"]
EXIT_CODE = {signal.SIGINT: 130, signal.SIGTERM: 143}

# Every test here starts a subprocess that imports torch: 2-5 s each on two cores.
pytestmark = pytest.mark.slow


def _corun_command() -> list[str]:
    script = Path(sys.executable).with_name("corun")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "corun.cli"]


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
        **tables: dict[str, Any],
    ) -> CorunRun:
        run_dir = tmp_path / "run"
        config = {
            "run": {"dir": str(run_dir), "steps": 3, **tables.pop("run", {})},
            "log": {"progress": "plain", **tables.pop("log", {})},
            "trainer": {"kind": "tests.fakes:FakeTrainer", "spawn_engine": True, **trainer},
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
            [*_corun_command(), "train", str(cfg), *overrides],
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
    unknown = [n for n in teardown if n not in TEARDOWN_ORDER]
    assert not unknown, f"unexpected teardown steps {unknown}"
    expected = [n for n in TEARDOWN_ORDER if n in teardown]
    assert teardown == expected, f"teardown order {teardown}, documented {TEARDOWN_ORDER}"
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
    assert "model" in tensors
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


# ----------------------------------------------------------------------------- moments


@dataclass(frozen=True)
class Moment:
    trainer: dict[str, Any]
    tables: dict[str, dict[str, Any]]
    wait: Callable[[CorunRun], None]
    complete: bool  # every teardown step registered by the time of the signal
    checkpoint_step: int | None  # the newest checkpoint after the run, if one must exist


def _wait_in_train_step_after_a_checkpoint(run: CorunRun) -> None:
    run.wait_event("checkpoint_written")
    # The marker is touched at each micro-batch; see a fresh touch, so the signal
    # lands inside a train step (step 2: step 1 has been saved).
    (run.run_dir / "phase-train").unlink(missing_ok=True)
    run.wait_phase("train")


MOMENTS = {
    # Interrupted inside Trainer.setup: the engine already runs, its teardown is
    # registered on the SetupContext, the runtime's save/checkpoints steps are not.
    "setup": Moment(
        trainer={"slow_in": "setup", "slow_s": 30.0},
        tables={},
        wait=lambda run: run.wait_phase("setup"),
        complete=False,
        checkpoint_step=None,
    ),
    "baseline_eval": Moment(
        trainer={"slow_in": "eval", "slow_s": 30.0},
        tables={},
        wait=lambda run: run.wait_phase("eval"),
        complete=True,
        checkpoint_step=None,
    ),
    # Slow micro-batches; step 1 is saved, the signal lands in step 2's train step.
    # Step 2 never completes, so there is nothing newer to save on interrupt.
    "train_step": Moment(
        trainer={"slow_in": "train", "slow_s": 0.25},
        tables={"run": {"steps": 6}, "loop": {"save_interval": 1}},
        wait=_wait_in_train_step_after_a_checkpoint,
        complete=True,
        checkpoint_step=1,
    ),
    # state_dict is slow: the signal cuts the step-1 snapshot short, and the save on
    # interrupt (teardown) then writes step 1 in full.
    "save": Moment(
        trainer={"slow_in": "save", "slow_s": 1.0},
        tables={"run": {"steps": 4}, "loop": {"save_interval": 1}},
        wait=lambda run: run.wait_phase("save"),
        complete=True,
        checkpoint_step=1,
    ),
}

# Async mode: three batches in flight on two rollout workers (their own threads).
ASYNC = {"concurrency": 3, "workers": 2}
MOMENTS |= {
    # Both workers generating, nothing trained yet.
    "async_rollout": Moment(
        trainer={"slow_in": "rollout", "slow_s": 30.0},
        tables={"loop": ASYNC},
        wait=lambda run: run.wait_phase("rollout"),
        complete=True,
        checkpoint_step=None,
    ),
    "async_train_step": Moment(
        trainer={"slow_in": "train", "slow_s": 0.25},
        tables={"run": {"steps": 6}, "loop": ASYNC | {"save_interval": 1}},
        wait=_wait_in_train_step_after_a_checkpoint,
        complete=True,
        checkpoint_step=1,
    ),
    # The first weight publish hangs while rollouts run ahead; the save on interrupt
    # then writes the trained step 1.
    "async_sync": Moment(
        trainer={"slow_in": "sync", "slow_s": 30.0},
        tables={"run": {"steps": 4}, "loop": ASYNC},
        wait=lambda run: run.wait_phase("sync"),
        complete=True,
        checkpoint_step=1,
    ),
    "async_save": Moment(
        trainer={"slow_in": "save", "slow_s": 1.0},
        tables={"run": {"steps": 4}, "loop": ASYNC | {"save_interval": 1}},
        wait=lambda run: run.wait_phase("save"),
        complete=True,
        checkpoint_step=1,
    ),
}

CASES = [
    pytest.param("setup", signal.SIGINT, "asyncio", id="setup-SIGINT-asyncio"),
    pytest.param("baseline_eval", signal.SIGINT, "asyncio", id="baseline_eval-SIGINT-asyncio"),
    pytest.param("train_step", signal.SIGINT, "asyncio", id="train_step-SIGINT-asyncio"),
    pytest.param("save", signal.SIGINT, "asyncio", id="save-SIGINT-asyncio"),
    pytest.param("baseline_eval", signal.SIGTERM, "asyncio", id="baseline_eval-SIGTERM-asyncio"),
    pytest.param("train_step", signal.SIGTERM, "asyncio", id="train_step-SIGTERM-asyncio"),
    pytest.param("train_step", signal.SIGINT, "trio", id="train_step-SIGINT-trio"),
    pytest.param("save", signal.SIGTERM, "trio", id="save-SIGTERM-trio"),
    pytest.param("async_rollout", signal.SIGINT, "asyncio", id="async_rollout-SIGINT-asyncio"),
    pytest.param("async_rollout", signal.SIGTERM, "trio", id="async_rollout-SIGTERM-trio"),
    pytest.param("async_train_step", signal.SIGINT, "trio", id="async_train-SIGINT-trio"),
    pytest.param("async_sync", signal.SIGINT, "asyncio", id="async_sync-SIGINT-asyncio"),
    pytest.param("async_save", signal.SIGINT, "asyncio", id="async_save-SIGINT-asyncio"),
]


@pytest.mark.parametrize(("moment", "sig", "backend"), CASES)
def test_signal_tears_down_in_order(
    start_corun: Callable[..., CorunRun], moment: str, sig: signal.Signals, backend: str
) -> None:
    m = MOMENTS[moment]
    run = start_corun(m.trainer, (f"run.backend={backend}",), **m.tables)
    m.wait(run)
    run.send(sig)
    code = run.wait_exit()

    events = assert_interrupted(run, code, sig, complete=m.complete)
    assert f"{sig.name}: stopping" in run.stderr()
    assert_latest_checkpoint_loads(run, expect_step=m.checkpoint_step)
    assert_engine_gone(run)

    names = [e["event"] for e in events]
    assert names[0] == "start"
    moment = moment.removeprefix("async_")
    if moment in ("rollout", "sync"):
        assert "teardown:save" in names
        assert max((e["step"] for e in events if e["event"] == "step"), default=0) <= 1
    if moment == "setup":
        assert "setup" not in names  # the trainer's setup never finished
    if moment == "baseline_eval":
        assert "baseline_eval" not in names and "step" not in names
    if moment == "train_step":
        assert max(e["step"] for e in events if e["event"] == "step") == 1
    if moment == "save":
        saved = [e for e in events if e["event"] == "checkpoint_written"]
        assert [e["step"] for e in saved] == [1]
        # The save ran inside teardown (the in-loop snapshot was cut short).
        assert names.index("teardown:save") > names.index("teardown:stop")
        assert names.index("checkpoint_written") < names.index("teardown:checkpoints")
    statuses = {e["event"]: e["status"] for e in events if e["event"].startswith("teardown:")}
    assert set(statuses.values()) == {"ok"}, statuses


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_second_signal_skips_the_save(start_corun: Callable[..., CorunRun], backend: str) -> None:
    """First SIGINT cuts the final save short; the save on interrupt then hangs in
    state_dict (slow_s = 60); a second SIGINT cuts it, logged as skipped, and the
    process exits promptly (well before the 30 s teardown timeout) with 130."""
    run = start_corun(
        {"slow_in": "save", "slow_s": 60.0},
        (f"run.backend={backend}",),
        run={"steps": 2},
    )
    marker = run.run_dir / "phase-save"
    run.wait_phase("save")  # the end-of-run save of step 2
    marker.unlink()
    run.send(signal.SIGINT)
    run.wait_event("teardown:stop")
    run.wait_phase("save")  # state_dict again: the save on interrupt, in teardown
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=15.0)

    events = assert_interrupted(run, code, signal.SIGINT)
    save = next(e for e in events if e["event"] == "teardown:save")
    assert save["status"] == "skipped", save
    # Resources are still released after the second signal.
    others = {e["event"]: e["status"] for e in events if e["event"].startswith("teardown:")}
    del others["teardown:save"]
    assert set(others.values()) == {"ok"}, others
    assert "skipping optional teardown steps" in run.stderr()
    assert checkpoint.latest(run.run_dir) is None
    assert_engine_gone(run)


def test_hard_deadline_ends_a_hanging_teardown(start_corun: Callable[..., CorunRun]) -> None:
    """on_train_end hangs for 30 s; run.hard_deadline_s = 1 ends the process anyway."""
    run = start_corun(
        {"slow_in": "end", "slow_s": 30.0},
        ("run.hard_deadline_s=1",),
        run={"steps": 100_000},
        log={"progress": "off"},
    )
    run.wait_phase("train")
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=10.0)  # 1 s deadline; far below the 30 s hang

    assert code == 130, run.stderr()
    assert "Traceback" not in run.stderr()
    assert "hard deadline" in run.stderr()
    events = run.events()
    names = [e["event"] for e in events]
    assert names[-1] == "end", names[-5:]
    assert events[-1]["reason"] == "killed", events[-1]
    # Teardown got as far as on_train_end, in order, before the deadline hit.
    teardown = [n for n in names if n.startswith("teardown:")]
    assert teardown == TEARDOWN_ORDER[:-1], teardown
    assert (run.run_dir / "phase-end").exists()
    assert_latest_checkpoint_loads(run, expect_step=None)
    assert_engine_gone(run)


def test_third_signal_exits_at_once(start_corun: Callable[..., CorunRun]) -> None:
    """A teardown step that is not optional hangs (on_train_end, 30 s): the second
    signal cannot cut it, the third ends the process at once."""
    run = start_corun(
        {"slow_in": "end", "slow_s": 30.0},
        run={"steps": 100_000},
        log={"progress": "off"},
    )
    run.wait_phase("train")
    run.send(signal.SIGINT)
    run.wait_phase("end")
    run.send(signal.SIGINT)
    run.wait_stderr("skipping optional teardown steps")
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=10.0)

    assert code == 130, run.stderr()
    assert "Traceback" not in run.stderr()
    events = run.events()
    assert events[-1]["event"] == "end"
    assert events[-1]["reason"] == "killed", events[-1]
    assert_engine_gone(run)
