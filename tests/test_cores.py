"""A lane's torch threads follow the cores other processes leave free (corun/execution/cores.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

from corun.execution import cores
from corun.execution.compute import Lane
from tests.support.config import make_config


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
async def test_a_lanes_threads_are_the_free_cores_over_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threads for a lane left at 0: the free cores, capped by the process's own
    setting, divided by the lanes that may compute side by side; re-read per call."""
    monkeypatch.setattr(cores, "free_cores", lambda: 4)
    torch.set_num_threads(4)  # the cap each lane reads when it is made
    alone, one_of_three = Lane("alone"), Lane("worker", share=3)
    try:
        with anyio.fail_after(20):
            assert await alone.run(torch.get_num_threads) == 4
            assert await one_of_three.run(torch.get_num_threads) == 1
            monkeypatch.setattr(cores, "free_cores", lambda: 2)  # a neighbour took 2
            assert await alone.run(torch.get_num_threads) == 2
            torch.set_num_threads(1)  # the cap was read when the lane was made
            assert await Lane("inline", "inline").run(torch.get_num_threads) == 1
    finally:
        alone.close()
        one_of_three.close()


def test_lanes_side_by_side_in_a_run(tmp_path: Path) -> None:
    sync = make_config(tmp_path, {"kind": "sft"})
    async_ = make_config(tmp_path, {"kind": "sft"}, loop={"concurrency": 3, "workers": 2})
    serving = make_config(tmp_path, {"kind": "sft"}, serve={"enabled": True})
    assert [cores.side_by_side(c) for c in (sync, async_, serving)] == [1, 3, 2]
