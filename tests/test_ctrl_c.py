"""Ctrl-C where it used to wait: in a set-up call that never reaches a cancel point
(a model load, an engine's build), and in the teardown of a run that had finished.

The ``corun`` command leaves a stopped set-up call to its thread (after
``SETUP_STOP_GRACE_S``) and exits once torn down; a stop during a finished run's
teardown cuts its optional steps, and a run so cut short ends "interrupted" (130).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from corun.loop.teardown import RunControl, Teardown
from corun.records.events import EventLog, read_records
from tests.support.corun_process import (
    CorunRun,
    assert_engine_gone,
    assert_interrupted,
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_signal_in_a_blocking_setup_call_does_not_wait_for_it(
    start_corun: Callable[..., CorunRun], backend: str
) -> None:
    """Set-up blocks for 60 s in one call without cancel points (as a model load does):
    SIGINT ends the run in order, its engine child stopped, exit 130, long before."""
    run = start_corun({"block_in": "setup", "block_s": 60.0}, (f"run.backend={backend}",))
    run.wait_phase("setup")
    sent = time.monotonic()
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=20.0)
    assert time.monotonic() - sent < 20.0  # not the 60 s the call would take
    events = assert_interrupted(run, code, signal.SIGINT, complete=False)
    names = [e["event"] for e in events]
    assert "setup" not in names  # the trainer's setup never finished
    assert "teardown:engine" in names  # what it had started was stopped
    assert_engine_gone(run)


@pytest.mark.slow
def test_a_signal_in_a_finished_runs_teardown_that_cuts_nothing_exits_0(
    start_corun: Callable[..., CorunRun],
) -> None:
    """The run trained its steps; on_train_end (not optional) takes 3 s. A SIGINT then
    has nothing to cut: teardown completes, the run ends "done", exit 0."""
    run = start_corun({"slow_in": "end", "slow_s": 3.0}, run={"steps": 2})
    run.wait_phase("end")
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=20.0)
    assert code == 0, run.stderr()
    end = run.events()[-1]
    assert end["event"] == "end" and end["reason"] == "done", end
    statuses = {e["event"]: e["status"] for e in run.events() if e["event"].startswith("teardown:")}
    assert set(statuses.values()) == {"ok"}, statuses


@pytest.mark.anyio
async def test_a_stop_during_teardown_cuts_the_optional_step_at_once(tmp_path: Path) -> None:
    """The first stop that arrives during teardown (a finished run's) cuts the
    optional step running: recorded as skipped and in ``cut_short``; the next steps
    still run."""
    events = EventLog(tmp_path)
    control = RunControl()
    teardown = Teardown(events, control, timeout_s=30.0)
    ran: list[str] = []
    teardown.push("release", lambda: ran.append("release"))

    async def optional_upload() -> None:
        control.stop("interrupted", signal="SIGINT")  # arrives while this step runs
        await anyio.sleep(30)

    teardown.push("upload", optional_upload, optional=True)
    with anyio.fail_after(10):
        assert await teardown.run(at_step=2) is None
    events.close()
    assert teardown.cut_short == ["upload"] and ran == ["release"]
    status = {r["event"]: r["status"] for r in read_records(tmp_path / "events.jsonl")}
    assert status["teardown:upload"] == "skipped" and status["teardown:release"] == "ok"
    assert control.outcome(None, 2).reason == "interrupted"
