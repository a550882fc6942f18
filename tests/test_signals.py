"""Real signals to a real ``corun train`` subprocess.

Each test writes a TOML config for the fake trainer (``tests.support.fakes:FakeTrainer``),
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

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from corun.records import checkpoint
from tests.support.corun_process import (
    CorunRun,
    assert_engine_gone,
    assert_interrupted,
    assert_latest_checkpoint_loads,
)
from tests.support.fakes import TEARDOWN_ORDER

# Every test here starts a subprocess that imports torch: 2-5 s each on two cores.
pytestmark = pytest.mark.slow


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


def test_sigusr1_prints_every_stack_and_the_run_goes_on(
    start_corun: Callable[..., CorunRun],
) -> None:
    """A hung run's post-mortem: SIGUSR1 prints each thread's stack to stderr (the
    train lane's and the event loop's), and the run trains on."""
    run = start_corun({}, run={"steps": 100_000}, log={"progress": "off"})
    run.wait_phase("train")
    run.send(signal.SIGUSR1)
    run.wait_stderr("(most recent call first)")
    steps = run.names().count("step")
    run.wait_until("a step after the dump", lambda: run.names().count("step") > steps)
    assert run.stderr().count("(most recent call first)") >= 2, run.stderr()  # all threads
    run.send(signal.SIGINT)
    assert run.wait_exit() == 130, run.stderr()
