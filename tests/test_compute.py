"""Compute lanes: one OS thread per lane, a per-lane torch thread budget, and
cooperative cancellation that never loses a completed call."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import corun
from corun.execution.compute import Lane, LaneClosed, cancel_point
from tests.support.config import make_config

pytestmark = pytest.mark.anyio


async def test_lane_keeps_one_thread_and_its_own_torch_budget() -> None:
    lane = Lane("t", "thread", torch_threads=3)  # neither the test default (1) nor the cores
    try:
        seen = [await lane.run(lambda: (threading.get_ident(), torch.get_num_threads()))
                for _ in range(5)]  # fmt: skip
    finally:
        lane.close()
    assert len({ident for ident, _ in seen}) == 1
    assert {threads for _, threads in seen} == {3}
    assert threading.get_ident() not in {ident for ident, _ in seen}


@pytest.mark.parametrize("mode", ["thread", "inline"])
async def test_a_closed_lane_refuses_calls_and_starts_no_thread(
    anyio_backend: str, mode: str
) -> None:
    """A task left over from an ended run (an engine's, on a test runner's shared loop)
    once called its closed lane again and got a fresh thread that nothing closed: it
    outlived the run ("corun-lane-engine" threads alive after an embedded run)."""
    lane = Lane("left", mode)  # type: ignore[arg-type]
    assert await lane.run(lambda: 1) == 1
    lane.close()
    before = set(threading.enumerate())
    with anyio.fail_after(10), pytest.raises(LaneClosed, match="lane 'left' was closed"):
        await lane.run(lambda: 2)
    assert not [t for t in set(threading.enumerate()) - before if t.name == "corun-lane-left"]


async def test_cancel_point_stops_a_running_call() -> None:
    lane = Lane("t")
    steps: list[int] = []

    def work() -> None:
        for i in range(500):
            steps.append(i)
            time.sleep(0.002)
            cancel_point()

    try:
        with anyio.fail_after(10), anyio.move_on_after(0.05):
            await lane.run(work)
    finally:
        lane.close()
    assert 0 < len(steps) < 500  # stopped at a cancel point, not at the end


async def test_completed_call_returns_its_result_despite_cancellation() -> None:
    """Cancelled while it runs, a call without cancel points completes; its caller
    gets the result (the cancellation lands at the caller's next await)."""
    lane = Lane("t")
    running, release = threading.Event(), threading.Event()

    def work() -> int:
        running.set()
        release.wait(10)
        return 42

    try:
        with anyio.fail_after(10):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tasks:

                    async def cancel_when_running() -> None:
                        await anyio.to_thread.run_sync(running.wait)
                        scope.cancel()
                        release.set()

                    tasks.start_soon(cancel_when_running)
                    result = await lane.run(work)
            assert result == 42
    finally:
        lane.close()


async def test_call_cancelled_while_queued_never_starts() -> None:
    """A caller cancelled before its call started gets the cancellation, and the
    call does not run: a loop of lane calls cannot outlive its cancellation."""
    lane = Lane("t")
    started: list[int] = []
    try:
        with anyio.fail_after(10):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await lane.run(started.append, 1)
            assert scope.cancelled_caught
            await lane.run(started.append, 2)  # the lane still serves the next call
        assert started == [2]
    finally:
        lane.close()


async def test_hand_offs_survive_cancellations_at_any_moment() -> None:
    """Calls cancelled before, during and just after they run: each caller gets its
    result or its cancellation (a call that ran to the end is never lost), nothing
    waits forever, and the lane still serves afterwards."""
    lane = Lane("t")
    ran: list[int] = []
    returned: list[int] = []

    def work(i: int) -> int:
        ran.append(i)
        time.sleep(0.0002 * (i % 3))
        return i

    async def caller(i: int) -> None:
        with anyio.CancelScope() as scope:
            if i % 4 == 0:
                scope.cancel()  # before the call is awaited
            elif i % 4 == 1:
                scope.deadline = anyio.current_time() + 0.0001 * (i % 5)  # while queued/running
            returned.append(await lane.run(work, i))

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                for i in range(300):
                    tasks.start_soon(caller, i)
            assert await lane.run(lambda: "still serving") == "still serving"
    finally:
        lane.close()
    assert set(returned) <= set(ran)
    assert {i for i in ran if i % 4 in (2, 3)} <= set(returned)  # never cancelled: returned


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/fd")
async def test_a_lane_reuses_its_few_wake_up_sockets() -> None:
    """On trio a call's return is signalled through a socket pair: many calls reuse a
    few, however many wait at once, and closing the lane closes them."""

    def open_fds() -> int:
        return len(list(Path("/proc/self/fd").iterdir()))

    before = open_fds()
    lane = Lane("t")
    try:
        with anyio.fail_after(20):
            for i in range(200):
                assert await lane.run(int, i) == i
            results: list[int] = []
            async with anyio.create_task_group() as tasks:
                for i in range(100):  # more than the lane keeps: the rest go another way
                    tasks.start_soon(lambda i=i: _append(results, lane.run(int, i)))
            assert sorted(results) == list(range(100))
            during = open_fds()
    finally:
        lane.close()
    assert during - before <= 2 * 8 + 2  # the pairs a lane keeps, and a wake-up pipe
    assert open_fds() <= before + 2


async def _append(results: list[int], call: Any) -> None:
    results.append(await call)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_preload_maps_triton_without_importing_it() -> None:
    """The library set-up's first optimizer loads (holding the GIL) is mapped early by
    preload, GIL released, and triton itself is not imported (corun/execution/preload.py)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    probe = (
        "import sys, torch\n"
        "from corun.execution import preload\n"
        "preload.preload()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('triton' in sys.modules, 'libtriton' in maps)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)  # fmt: skip
    assert result.stdout.split() == ["False", "True"]


class ThreadCountTrainer(corun.Trainer[corun.TrainerConfig]):
    """Records torch's intra-op thread count where its hooks run."""

    def setup(self, ctx: corun.SetupContext) -> None:
        self.seen: set[int] = set()

    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> corun.Batch:
        self.seen.add(torch.get_num_threads())
        return corun.Batch(inputs)

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        self.seen.add(torch.get_num_threads())
        return {}


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_lane_threads_sets_every_lanes_torch_budget(tmp_path: Path, concurrency: int) -> None:
    config = make_config(
        tmp_path, {"kind": "tests.test_compute:ThreadCountTrainer"}, run={"steps": 3},
        loop={"lane_threads": 3, "concurrency": concurrency, "baseline_eval": False},
    )  # fmt: skip
    trainer = ThreadCountTrainer(config)
    with anyio.fail_after(30):
        await corun.run(trainer, config)
    assert trainer.seen == {3}  # neither the test default (1) nor the machine's cores
