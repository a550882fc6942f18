"""Ctrl-C reaches the ranks one after another: a rank whose peer stopped first, in the
collective that follows an applied step, books the step and stops as interrupted
(CI once saw rank 1 end with "error": its metrics all-reduce lost rank 0; and once both
ranks still running 30 s after Ctrl-C: rank 1 waited in that all-reduce for a rank 0
that had abandoned the step before it and was alive, so nothing failed)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest

from corun.execution import distributed
from corun.execution.compute import Lane


def _peer_gone(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("Connection closed by peer [127.0.0.1]:33666")


class _NeverPosted:
    """The pending all-reduce of a rank whose peer never joins it."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("waited on a collective that cannot complete")


@pytest.fixture(params=["peer-gone", "peer-never-posts"])
def rank_1_of_2(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "world", lambda: distributed.World(1, 2))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    if request.param == "peer-gone":
        monkeypatch.setattr(distributed.dist, "all_reduce", _peer_gone)
    else:
        monkeypatch.setattr(distributed.dist, "all_reduce", lambda *a, **k: _NeverPosted())


@pytest.mark.anyio
@pytest.mark.usefixtures("rank_1_of_2")
async def test_an_applied_steps_metrics_survive_a_peer_that_stopped_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(distributed, "_timeout_s", [20.0])  # the grace ends it, not this
    lane = Lane("train")
    failing = anyio.Event()
    token = anyio.lowlevel.current_token()

    def applied_step() -> dict[str, float]:
        with distributed.uncancellable():  # as corun/loop/update.py after the optimizer step
            anyio.from_thread.run_sync(failing.set, token=token)
            return distributed.mean_metrics({"train/loss": 2.0, "perf/train_time_s": 0.1})

    booked: list[dict[str, float]] = []
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:

                async def train() -> None:
                    booked.append(await lane.run(applied_step))

                tasks.start_soon(train)
                await failing.wait()
                tasks.cancel_scope.cancel()  # this rank's own Ctrl-C, during the grace
    finally:
        lane.close()
    assert booked == [{"train/loss": 2.0, "perf/train_time_s": 0.1}]


@pytest.mark.anyio
@pytest.mark.usefixtures("rank_1_of_2")
async def test_a_peer_lost_without_a_stop_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "_STOP_GRACE_S", 0.2)
    monkeypatch.setattr(distributed, "_timeout_s", [0.5])  # a peer that never posts
    lane = Lane("train")

    def applied_step() -> dict[str, float]:
        with distributed.uncancellable():
            return distributed.mean_metrics({"train/loss": 2.0})

    try:
        with anyio.fail_after(10), pytest.raises(distributed.CollectiveError, match="rank 1"):
            await lane.run(applied_step)
    finally:
        lane.close()
