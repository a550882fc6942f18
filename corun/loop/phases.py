"""How the loop records its phases (train, sync, eval, rollout) and its waits: one
helper instead of a pair of clock reads around each, all on the run's time base
(corun/base/timebase.py, virtual under ``corun simulate``).

A phase is traced as a span while it runs; once it has ended, its metrics are logged
with ``perf/<timing>_time_s`` and its event is emitted, both at the clock's step. A
phase that fails leaves only its span.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from corun.base import timebase
from corun.contract.trainer import Image, Metrics, is_alert
from corun.loop.clock import Clock
from corun.records.events import EventLog, Trace


@dataclass
class Stopwatch:
    """A block's duration in seconds, once it ended without an error (else 0)."""

    started: float = field(default_factory=timebase.monotonic)
    seconds: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    watch = Stopwatch()
    yield watch
    watch.seconds = timebase.monotonic() - watch.started


@contextmanager
def timed_span(trace: Trace, name: str, track: str, **args: Any) -> Iterator[Stopwatch]:
    """The block as span ``name`` of ``track``, and its duration."""
    with trace.span(name, track, **args), stopwatch() as watch:
        yield watch


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

    @contextmanager
    def phase(
        self, name: str, timing: str, event: str | None = None, **span: Any
    ) -> Iterator[Phase]:
        """Span ``name`` (with ``span`` args); then the metrics the block put in the
        :class:`Phase`, with ``perf/<timing>_time_s``, and event ``event`` (``name``)."""
        phase = Phase()
        with timed_span(self.trace, name, "trainer", **span) as watch:
            yield phase
        phase.metrics[f"perf/{timing}_time_s"] = watch.seconds
        self.log(self.clock.step, phase.metrics)
        self.events.emit(event or name, self.clock.step, **phase.fields)
        for key, value in phase.metrics.items():
            if is_alert(key) and isinstance(value, float | int) and value > 0:
                self.events.emit("alert", self.clock.step, metric=key, value=value)
