"""How the loop records its phases (train, sync, eval, rollout) and its waits: one
helper instead of a pair of clock reads around each, all on the run's time base
(corun/base/timebase.py, virtual under ``corun simulate``).

A phase is traced as a span while it runs; once it has ended, its metrics are logged
with ``perf/<timing>_time_s`` and its event is emitted, both at the clock's step. A
phase that fails leaves only its span.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

from corun.base import timebase
from corun.contract.trainer import Image, Metrics, is_alert
from corun.loop.clock import Clock
from corun.records.events import EventLog, Trace


class Mark(NamedTuple):
    """An instant on both of the run's clocks: spans are placed by wall time and timed
    by the monotonic one."""

    monotonic: float
    wall: float


def now() -> Mark:
    return Mark(timebase.monotonic(), timebase.wall())


class Stopwatch:
    """A block's duration in seconds, once it ended without an error (else 0).

    Context managers as classes, not generators, here and below: every step enters
    several, and a generator's frame and ``contextlib`` wrapper cost a few µs each."""

    __slots__ = ("seconds", "started")

    def __init__(self) -> None:
        self.started = timebase.monotonic()
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:  # fmt: skip
        if kind is None:
            self.seconds = timebase.monotonic() - self.started


def stopwatch() -> Stopwatch:
    """``with stopwatch() as watch:`` times the block (``watch.seconds``)."""
    return Stopwatch()


class TimedSpan(Stopwatch):
    """The block as span ``name`` of ``track`` in the trace (also when it fails), and
    its duration. What the block did may have begun (``since``) or ended
    (:meth:`ended_at`) elsewhere: on a lane's thread, in a call that did more."""

    __slots__ = ("args", "end", "name", "trace", "track", "wall")

    def __init__(
        self, trace: Trace, name: str, track: str, args: dict[str, Any], since: Mark | None = None
    ) -> None:
        self.trace, self.name, self.track, self.args = trace, name, track, args
        self.wall = timebase.wall()
        self.end: Mark | None = None
        super().__init__()
        if since is not None:
            self.started, self.wall = since

    def __enter__(self) -> TimedSpan:
        return self

    def ended_at(self, end: Mark) -> None:
        """The block's work ended at ``end``, before the block does."""
        self.end = end

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:  # fmt: skip
        end = self.end or now()
        if kind is None:
            self.seconds = end.monotonic - self.started
        self.trace.complete(self.name, self.track, self.wall, end.wall, **self.args)


def timed_span(trace: Trace, name: str, track: str, **args: Any) -> TimedSpan:
    """The block as span ``name`` of ``track``, and its duration."""
    return TimedSpan(trace, name, track, args)


@dataclass
class Phase:
    """What a phase reports when it ends: its metrics and its event's fields."""

    metrics: dict[str, float | Image] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)


class Phases:
    """The trainer track's phases, recorded in the run's trace, metrics and events."""

    def __init__(
        self, trace: Trace, events: EventLog, log: Callable[[int, Metrics], None], clock: Clock
    ) -> None:
        self.trace = trace
        self.events = events
        self.log = log
        self.clock = clock

    def phase(
        self, name: str, timing: str, event: str | None = None, since: Mark | None = None,
        **span: Any,
    ) -> _Recording:  # fmt: skip
        """Span ``name`` (with ``span`` args; begun ``since``, or now); then the metrics
        the block put in the :class:`Phase`, with ``perf/<timing>_time_s``, and event
        ``event`` (``name``)."""
        recorded = TimedSpan(self.trace, name, "trainer", span, since)
        return _Recording(self, recorded, timing, event or name)

    def record(self, phase: Phase, timing: str, event: str, seconds: float) -> None:
        """A phase that ended: its metrics, its event and an event per raised alert."""
        phase.metrics[f"perf/{timing}_time_s"] = seconds
        step = self.clock.step
        self.log(step, phase.metrics)
        self.events.emit(event, step, **phase.fields)
        for key, value in phase.metrics.items():
            if "alert" in key and is_alert(key) and isinstance(value, float | int) and value > 0:
                self.events.emit("alert", step, metric=key, value=value)


class _Recording:
    """``with phases.phase(...) as phase:``; a phase that fails leaves only its span."""

    __slots__ = ("event", "phase", "phases", "span", "timing")

    def __init__(self, phases: Phases, span: TimedSpan, timing: str, event: str) -> None:
        self.phases, self.span, self.timing, self.event = phases, span, timing, event
        self.phase = Phase()

    def __enter__(self) -> Phase:
        return self.phase

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:  # fmt: skip
        self.span.__exit__(kind, error, traceback)
        if kind is None:
            self.phases.record(self.phase, self.timing, self.event, self.span.seconds)
