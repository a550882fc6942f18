"""The interrupt storm's checks (tests/support/storm.py): a case, its uninterrupted reference
run, and what one interrupted run and its resume must satisfy."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corun.records import checkpoint
from tests.support.corun_process import EXIT_CODE, assert_teardown_order
from tests.support.processes import REPO, corun_command, events
from tests.support.storm_procs import Child, final_state, first_difference, last_run

# Small models, a few seconds a run; a checkpoint every 4 steps, an eval every 20.
_COMMON = "loop.lane_threads=1 log.progress=off loop.save_interval=4 loop.eval_interval=20"


@dataclass(frozen=True)
class Case:
    name: str
    config: str  # under configs/
    overrides: str  # space-separated
    steps: int = 60
    ci: bool = True  # in the CI-sized storm
    timeout_s: float = 300.0  # an uninterrupted run (or a resume) ends within this (loaded CI)
    accumulate: int = 1  # loop.accumulate of its config: saves fall on window starts

    def command(self, run_dir: Path, *extra: str) -> list[str]:
        config = str(REPO / "configs" / self.config)
        settings = [*_COMMON.split(), *self.overrides.split(), f"run.steps={self.steps}"]
        return [*corun_command(), "train", config, *settings, f"run.dir={run_dir}", *extra]


# ----------------------------------------------------------------------------- one run


@dataclass
class Reference:
    """An uninterrupted run of a case: its final state and when its phases began."""

    case: Case
    state: dict[str, Any]
    tensors: Any
    started_s: float  # `start` event, seconds after launch
    set_up_s: float  # `setup` event
    ended_s: float  # `end` event
    said: frozenset[str]  # its stderr lines (digits masked): start-up noise of libraries

    def window(self, phase: str) -> tuple[float, float]:
        edges = {
            "imports": (0.0, self.started_s),
            "setup": (self.started_s, self.set_up_s),
            "train": (self.set_up_s, self.ended_s),
        }
        return edges[phase]


def reference(case: Case, work: Path) -> Reference:
    run_dir = work / f"reference-{case.name}" / "run"
    child = Child.start(case.command(run_dir), run_dir.parent)
    try:
        code = child.wait(case.timeout_s)
        if code != 0:
            raise RuntimeError(f"reference run of {case.name}: exit {code}\n{child.stderr()}")
        records = events(run_dir)
        at = {r["event"]: r["t"] - child.launched for r in records if "t" in r}
        state, tensors = final_state(run_dir, case.steps)
        said = frozenset(_masked(line) for line in child.stderr().splitlines())
        return Reference(case, state, tensors, at["start"], at["setup"], at["end"], said)
    finally:
        child.close()


@dataclass
class Result:
    seed: int
    case: str
    signal: str
    backend: str
    aimed: str  # the phase the moment was drawn in
    delay_s: float
    landed: str = ""  # imports, setup, train, teardown, after-end, after-exit
    stepped: int = 0  # steps done when the signal was sent
    code: int | None = None
    teardown_s: float | None = None  # signal to exit
    restored: int | None = None  # the step the resume restored (None: fresh / none)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        took = f"{self.teardown_s:.2f} s" if self.teardown_s is not None else "-"
        head = (
            f"seed {self.seed:>5} {self.case:<14} {self.signal:<7} {self.backend:<7} "
            f"at {self.delay_s:6.2f} s ({self.landed:<10}) exit {self.code} in {took}"
        )
        return head + ("" if self.ok else "  FAIL: " + "; ".join(self.failures))


def check_interrupted(
    case: Case,
    ref: Reference,
    result: Result,
    sig: signal.Signals,
    child: Child,
    run_dir: Path,
    said: int,
) -> list[str]:
    failures = []
    stderr = child.stderr()
    records = events(run_dir)
    names = [r["event"] for r in records]
    code, expected = result.code, EXIT_CODE[sig]
    left = child.watch.wait_gone()
    if left:
        failures.append(f"processes left: {left}")
    if "Traceback" in stderr:
        failures.append("traceback on stderr: " + _traceback_tail(stderr))
    if names and names[-1] == "end" and records[-1]["reason"] == "done":
        # Fine only if the signal came after the outcome (in the teardown of a finished
        # run, or in interpreter exit): exit 0, or killed by it after the handlers went.
        # (The last step in flight when the signal came may finish first.)
        late = result.landed in ("teardown", "after-end", "after-exit")
        if not late and result.stepped < case.steps - 1:
            failures.append(
                f"the signal was lost: sent after {result.stepped} steps ({result.landed}), "
                f"the run went on to finish its {case.steps} steps"
            )
        if code not in (0, expected, -sig):
            failures.append(f"exit {code} after a finished run")
        if records[-1]["step"] != case.steps:
            failures.append(f"'done' after {records[-1]['step']} of {case.steps} steps")
        return failures
    if result.landed == "after-exit":
        return [*failures, f"exit {code} and no `end` (reason done) before the signal"]
    if "start" not in names:  # corun's handlers not installed yet: killed by it is fine
        if code not in (expected, -sig):
            failures.append(f"exit {code}, expected {expected} (before the run started)")
    elif code != expected:
        failures.append(f"exit {code}, expected {expected}")
    if "setup" not in names:  # interrupted in imports or set-up: at most one line, its own
        after = child.stderr_bytes()[said:].decode(errors="replace")
        lines = [line for line in after.splitlines() if line.strip()]
        lines = [line for line in lines if _masked(line) not in ref.said]
        if len(lines) > 1:
            failures.append(f"{len(lines)} lines on stderr after the signal: {lines[:3]}")
    if "start" not in names:
        return failures
    try:
        end = records[-1]
        assert end["event"] == "end", f"last event {end['event']!r}"
        assert end["reason"] == "interrupted", f"end reason {end['reason']!r}"
        assert end.get("signal") == sig.name, f"end signal {end.get('signal')!r}"
        assert_teardown_order(names, complete=False)
        if "setup" in names:
            missing = {"teardown:save", "teardown:checkpoints"} - set(names)
            assert not missing, f"teardown steps missing: {sorted(missing)}"
        bad = [
            (r["event"], r["status"])
            for r in records
            if r["event"].startswith("teardown:") and r.get("status") != "ok"
        ]
        assert not bad, f"teardown steps not ok: {bad}"
    except AssertionError as exc:
        failures.append(str(exc).splitlines()[0])
    partial = list(checkpoint.checkpoints_dir(run_dir).glob(".tmp-*"))
    if partial:
        failures.append(f"partial checkpoint directories left: {[p.name for p in partial]}")
    failures += _check_checkpoints(records, run_dir, case.accumulate)
    return failures


def _check_checkpoints(records: list[dict[str, Any]], run_dir: Path, accumulate: int) -> list[str]:
    """Every checkpoint loads; the newest is the last step the run completed (its
    window's start with accumulation) when the save on interrupt ran."""
    failures = []
    found = checkpoint.list_checkpoints(run_dir)
    for _, path in found:
        try:
            checkpoint.read(path)
        except Exception as exc:
            failures.append(f"{path.name} does not load: {exc}")
    stepped = records[-1]["step"]  # the `end` event: the steps the run completed
    saved = [r for r in records if r["event"] == "teardown:save" and r.get("status") == "ok"]
    newest = found[-1][0] if found else 0
    if newest > stepped:
        failures.append(f"checkpoint step-{newest} newer than the last step {stepped}")
    window = max((r.get("step", 0) for r in records if r["event"] == "save"), default=0)
    if saved and stepped and newest < max(window, stepped - stepped % accumulate):
        failures.append(f"newest checkpoint step-{newest} after {stepped} steps")
    return failures


def check_resume(case: Case, ref: Reference, result: Result, run_dir: Path, out: Path) -> list[str]:
    before = checkpoint.latest(run_dir)
    child = Child.start(
        case.command(run_dir, f"run.backend={result.backend}", "checkpoint.resume=true"),
        out / "resume",
    )
    try:
        code = child.wait(case.timeout_s)
        if code is None:
            return [f"resume still running after {case.timeout_s:.0f} s"]
        if code != 0:
            return [f"resume exit {code}: {_traceback_tail(child.stderr())}"]
        left = child.watch.wait_gone()
    finally:
        child.close()
    failures = [f"processes left by the resume: {left}"] if left else []
    records = last_run(events(run_dir))
    restores = [r["step"] for r in records if r["event"] == "restore"]
    result.restored = restores[0] if restores else None
    expected = checkpoint.read(before)[0].step if before is not None else None
    if result.restored != expected:
        failures.append(f"resume restored {result.restored}, newest checkpoint {expected}")
    try:
        state, tensors = final_state(run_dir, case.steps)
    except Exception as exc:
        return [*failures, f"no final checkpoint after the resume: {exc}"]
    if state != ref.state:
        failures.append(f"final state {state} != uninterrupted {ref.state}")
    if result.restored == case.steps:
        # The resume had nothing to train: the final checkpoint is the save on interrupt
        # of the last step. Taken before that step's weight publish, its runtime-side
        # state (under the fixed schedule, the rollout weights kept for the versions the
        # schedule may still ask for) is one publish behind the uninterrupted run's
        # final save; a run continued from it stays bitwise equal. Compare the trainer's.
        ref_tensors, tensors = ref.tensors["trainer"], tensors["trainer"]
    else:
        ref_tensors = ref.tensors
    differs = first_difference(ref_tensors, tensors)
    if differs:
        failures.append(f"final weights differ from the uninterrupted run at {differs}")
    return failures


def _masked(line: str) -> str:
    """A stderr line with its digits masked (a library's time stamps, pids)."""
    return re.sub(r"\d+", "0", line.strip())


def _traceback_tail(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-2:])[:300]
