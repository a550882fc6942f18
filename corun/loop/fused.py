"""One lane call a step: at concurrency 1 in thread compute, a step's update runs in the
lane call of the rollout that made its batch, right after it.

A rollout starts only once the previous step has completed, and between a rollout and
the update of its batch the loop does only bookkeeping (the batch's records, the
staleness check), on the same lane. Each lane call costs two thread wake-ups and a pass
of the event loop (about 70 µs on 2 cores: most of what a no-op step costs), so the
step makes one instead of two. The calls and their order are those of a hand-written
loop, as with two calls; the loop records the same spans, idle times and metrics, with
the hand-over's time measured on the lane's thread.

The update is left to the loop (its own call, or none, exactly as with two calls) when
the batch is over the staleness bound (the loop drops it), when the run is being
stopped (the finished batch is not trained), or when the update stops at
a cancel point (:class:`LaneCancelled`: nothing applied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corun.contract.trainer import Batch
from corun.execution.compute import LaneCancelled, stop_requested
from corun.loop.clock import Clock
from corun.loop.phases import Mark, now


class Ran:
    """An update run in its rollout's call: when the batch was handed over, and what
    the update returned or raised."""

    __slots__ = ("error", "handed", "result")

    def __init__(self, handed: Mark) -> None:
        self.handed = handed
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """What the update returned (raises what it raised)."""
        if self.error is not None:
            raise self.error
        return self.result


class FusedUpdate:
    """The step's update (``update(batch)``, a plain call for the train lane) for the
    producer to run after the rollout, on the lane's thread, and for the loop to take."""

    def __init__(self, update: Callable[[Batch], Any], clock: Clock) -> None:
        self.update = update
        self.clock = clock
        self._ran: tuple[Batch, Ran] | None = None

    def after_rollout(self, batch: Batch) -> Mark:
        """On the lane's thread, once ``batch`` is made: the update, unless the loop must
        decide (a stale batch, a stop). The batch's hand-over time."""
        handed = now()
        if stop_requested() or self.clock.is_stale(batch.version):
            return handed
        ran = Ran(handed)
        try:
            ran.result = self.update(batch)
        except LaneCancelled:  # stopped at a cancel point: nothing applied
            return handed
        except BaseException as exc:  # the loop raises it in the step, as from its own call
            ran.error = exc
        self._ran = (batch, ran)
        return handed

    def take(self, batch: Batch) -> Ran | None:
        """On the loop: the update run with ``batch``'s rollout, if one was. (At
        concurrency 1 the producer hands on the batch it just made: an update run with
        another one would be an applied update lost from the books.)"""
        ran, self._ran = self._ran, None
        if ran is None:
            return None
        assert ran[0] is batch, "an update ran with a batch the loop did not take"
        return ran[1]
