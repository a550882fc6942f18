"""A lane's torch threads follow the cores other processes leave free (corun/cores.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest
import torch

from corun import cores
from corun.compute import Lane


def _ticks(samples: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    yield from samples


def test_free_cores_subtract_other_processes_work_with_hysteresis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy ticks of all CPUs minus this process's, per tick of wall time: others'
    cores. A change under HYSTERESIS cores leaves the estimate where it was."""
    free = cores.FreeCores()
    free.cores = free._all_cores = 4
    free._ticks_per_s = 100
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0])
    # (busy of all CPUs, ours), one second apart: others use 0, 1.5 (judged 2), 1.9
    # (kept at 2), 0.3 (judged 0) cores.
    readings = _ticks([(0, 0), (200, 200), (550, 400), (940, 600), (1130, 760)])
    free.clock = lambda: next(clock)
    monkeypatch.setattr(cores, "_read_ticks", lambda: next(readings))
    assert [free() for _ in range(5)] == [4, 4, 2, 2, 4]


def test_a_busy_neighbour_takes_a_core_off_the_estimate() -> None:
    """Measured on this machine: a process spinning beside us is seen within a second."""
    free = cores.FreeCores()
    free()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 3.0
        seen = free()
        while seen == free.cores and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = free()
    finally:
        hog.kill()
        hog.wait()
    assert seen <= free.cores - 1 or free.cores == 1


@pytest.mark.anyio
async def test_a_lane_starting_a_call_beside_another_gets_a_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threads for a lane left at 0: the free cores, capped by the process's own
    setting, split among the lanes in a call when this one starts its call."""
    monkeypatch.setattr(cores, "free_cores", lambda: 4)
    torch.set_num_threads(4)  # the cap each lane reads when it is made
    first, second = Lane("a"), Lane("b")
    first_in, second_done = threading.Event(), threading.Event()

    def hold() -> int:
        first_in.set()
        second_done.wait(10)
        return torch.get_num_threads()

    def beside() -> int:
        try:
            return torch.get_num_threads()
        finally:
            second_done.set()

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                alone: list[int] = []

                async def hold_first() -> None:
                    alone.append(await first.run(hold))

                tasks.start_soon(hold_first)
                await anyio.to_thread.run_sync(first_in.wait, 10)
                assert await second.run(beside) == 2
            assert alone == [4]
            monkeypatch.setattr(cores, "free_cores", lambda: 1)  # a neighbour took 3
            assert await first.run(torch.get_num_threads) == 1
            assert await second.run(torch.get_num_threads) == 1
    finally:
        first.close()
        second.close()
