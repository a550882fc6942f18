"""Teardown: resources are released in the reverse order they were set up.

A standard run registers, in set-up order: ``on_train_end`` → ``logging`` → the
trainer's own resources (rollout engine, then weight-sync channel) →
``checkpoints`` (drain pending writes) → ``save`` (save on interrupt). Teardown runs
the reverse, so the documented order holds on a clean exit, an error and an
interrupt alike:

    stop (producers cancelled, the running step returned) → save → checkpoints
    → weight sync → engine → logging → on_train_end → end

Each step runs shielded from the cancellation that caused the teardown and under its
own deadline (a lane call it awaits that is stuck past it is abandoned). A step that
fails or times out is logged and the next one still runs; the first error is the one
that propagates. A step marked optional (the save) is skipped, or cut short, once the
run is stopped a second time — or the first time, when that stop arrives during the
teardown of a run that had finished (there is nothing else left for it to stop). A
finished run whose teardown a stop cut short ends "interrupted", not "done".
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from corun.base import timebase
from corun.base.errors import first_error, is_cancellation
from corun.contract.trainer import Outcome
from corun.execution.compute import ABANDON_GRACE_S, abandoning
from corun.records.events import EventLog

log = logging.getLogger("corun")


class RunControl:
    """Stops a run from outside: the CLI's signal handler, a host service, a test.

    The first ``stop`` cancels the run's root scope and teardown runs in full; a
    second ``stop`` makes teardown urgent (optional steps skipped or cut short).
    Call it from the event loop's thread.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signal: str | None = None
        self.urgent = False
        self._root: anyio.CancelScope | None = None
        self._optional_step: anyio.CancelScope | None = None
        self.tearing_down = False  # a stop now has nothing left to stop but teardown

    @property
    def stopped(self) -> bool:
        return self.reason is not None

    def stop(self, reason: str = "interrupted", signal: str | None = None) -> None:
        if self.reason is None:
            self.reason, self.signal = reason, signal
            if self._root is not None:
                self._root.cancel()
            if not self.tearing_down:
                return
        self.urgent = True
        if self._optional_step is not None:
            self._optional_step.cancel()

    def bind(self, root: anyio.CancelScope) -> None:
        self._root = root
        if self.reason is not None:
            root.cancel()

    def outcome(self, failure: BaseException | None, step: int) -> Outcome:
        """How a run ended at ``step``, given its first error (or cancellation) and the
        stops it was sent."""
        if failure is None and not self.stopped:
            return Outcome("done", step)
        if failure is not None and not is_cancellation(failure):
            return Outcome("error", step, error=first_error(failure))
        if self.stopped and self.reason != "error":
            return Outcome("interrupted", step, signal=self.signal)
        return Outcome("cancelled", step)


@dataclass
class TeardownStep:
    name: str
    fn: Callable[[], Any]
    optional: bool = False


class Teardown:
    """An ordered stack of teardown steps, run in reverse, each shielded and bounded."""

    def __init__(
        self, events: EventLog, control: RunControl, timeout_s: float, inline: bool = False
    ) -> None:
        self.inline = inline  # blocking steps on the loop (no threads): not abandonable
        self.events = events
        self.control = control
        self.timeout_s = timeout_s
        self.steps: list[TeardownStep] = []
        self.step = 0  # the run's step when stopped, for event records
        self.cut_short: list[str] = []  # steps a stop skipped or cut

    def push(self, name: str, fn: Callable[[], Any], optional: bool = False) -> None:
        self.steps.append(TeardownStep(name, fn, optional))

    async def run(self, at_step: int) -> BaseException | None:
        """Run every step in reverse, the run stopped at ``at_step``; return the first
        error (not raised here)."""
        self.step = at_step
        self.control.tearing_down = True
        self.events.emit("teardown:stop", at_step, status="ok")
        first: BaseException | None = None
        while self.steps:
            step = self.steps.pop()
            if step.optional and self.control.urgent:
                self.events.emit(f"teardown:{step.name}", self.step, status="skipped")
                self.cut_short.append(step.name)
                continue
            started = timebase.monotonic()
            status = "ok"
            error: BaseException | None = None
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + self.timeout_s
                if step.optional:
                    self.control._optional_step = scope
                try:  # a lane call stuck past the deadline is abandoned (execution/compute.py)
                    with abandoning(min(self.timeout_s, ABANDON_GRACE_S)):
                        await _call(step.fn, self.inline)
                except Exception as exc:
                    status, error = "error", exc
                finally:
                    self.control._optional_step = None
            if scope.cancelled_caught:
                status = "skipped" if self.control.urgent and step.optional else "timeout"
                if status == "skipped":
                    self.cut_short.append(step.name)
            fields: dict[str, Any] = {"status": status}
            fields["duration_s"] = round(timebase.monotonic() - started, 6)
            if error is not None:
                fields["error"] = f"{type(error).__name__}: {error}"
                log.error("teardown step %s failed: %s", step.name, fields["error"])
                first = first or error
            elif status == "timeout":
                log.error("teardown step %s timed out after %.1f s", step.name, self.timeout_s)
            self.events.emit(f"teardown:{step.name}", self.step, **fields)
        return first


async def _call(fn: Callable[[], Any], inline: bool) -> None:
    """Await an async step; run a blocking one on a thread, abandoned at its deadline
    (or, inline, on the loop)."""
    if inspect.iscoroutinefunction(fn):
        await fn()
        return
    if inline:
        result = fn()
    else:
        result = await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
    if inspect.isawaitable(result):
        await result


def record_end(events: EventLog, step: int, outcome: Outcome) -> None:
    """The run's last event, ``end``: how it ended; then the event log is closed."""
    fields: dict[str, Any] = {"reason": outcome.reason}
    if outcome.signal:
        fields["signal"] = outcome.signal
    if outcome.error is not None:
        fields["error"] = f"{type(outcome.error).__name__}: {outcome.error}"
    events.emit("end", step, **fields)
    events.close()
