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
async def test_a_lanes_threads_are_fixed_whatever_else_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threads for a lane left at 0 (the default): the machine's cores, capped by the
    process's own setting, divided by the lanes that may compute side by side, and
    the same whatever the machine's load (the weights a seed gives depend on it)."""
    monkeypatch.setattr(cores, "machine_cores", lambda: 4)
    monkeypatch.setattr(cores, "free_cores", lambda: 4)
    torch.set_num_threads(4)  # the cap each lane reads when it is made
    alone, one_of_three = Lane("alone"), Lane("worker", share=3)
    try:
        with anyio.fail_after(20):
            assert alone.threads == 4 and one_of_three.threads == 1
            assert await alone.run(torch.get_num_threads) == 4
            monkeypatch.setattr(cores, "free_cores", lambda: 1)  # a neighbour took 3
            assert await alone.run(torch.get_num_threads) == 4
            assert await one_of_three.run(torch.get_num_threads) == 1
    finally:
        alone.close()
        one_of_three.close()


@pytest.mark.anyio
async def test_adapting_lanes_follow_the_free_cores_over_their_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``loop.adapt_threads``: the free cores, capped by the process's own
    setting, divided by the lanes that may compute side by side; re-read per call."""
    monkeypatch.setattr(cores, "free_cores", lambda: 4)
    torch.set_num_threads(4)  # the cap each lane reads when it is made
    alone, one_of_three = Lane("alone", adapt=True), Lane("worker", share=3, adapt=True)
    assert alone.threads is None
    try:
        with anyio.fail_after(20):
            assert await alone.run(torch.get_num_threads) == 4
            assert await one_of_three.run(torch.get_num_threads) == 1
            monkeypatch.setattr(cores, "free_cores", lambda: 2)  # a neighbour took 2
            assert await alone.run(torch.get_num_threads) == 2
            torch.set_num_threads(1)  # the cap was read when the lane was made
            assert await Lane("inline", "inline", adapt=True).run(torch.get_num_threads) == 1
    finally:
        alone.close()
        one_of_three.close()


def test_lanes_side_by_side_in_a_run(tmp_path: Path) -> None:
    sync = make_config(tmp_path, {"kind": "sft"})
    async_ = make_config(tmp_path, {"kind": "sft"}, loop={"concurrency": 3, "workers": 2})
    serving = make_config(tmp_path, {"kind": "sft"}, serve={"enabled": True})
    assert [cores.side_by_side(c) for c in (sync, async_, serving)] == [1, 3, 2]


def _train_sft(run_dir: Path, busy: bool) -> dict[str, torch.Tensor]:
    """``corun train sft`` for 30 steps with default settings (beside a busy process if
    asked); its final weights."""
    from tests.support.processes import REPO, corun_command, environment

    default_threads = {k: v for k, v in environment().items() if k != "OMP_NUM_THREADS"}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        done = subprocess.run(
            [*corun_command(), "train", "sft", f"run.dir={run_dir}", "run.steps=30",
             "loop.eval_interval=0", "loop.save_interval=30", "loop.baseline_eval=false",
             "log.progress=off"],
            cwd=REPO, env=default_threads, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    state = torch.load(run_dir / "checkpoints" / "step-30" / "trainer.pt", weights_only=True)
    return dict(state["trainer"]["model"])


@pytest.mark.slow
def test_a_run_beside_a_busy_process_equals_the_quiet_run_bitwise(tmp_path: Path) -> None:
    """Default settings: the lanes' thread counts do not follow the machine's load, so
    the same seed gives the same weights, bit for bit, with a busy process beside it."""
    quiet = _train_sft(tmp_path / "quiet", busy=False)
    shared = _train_sft(tmp_path / "shared", busy=True)
    assert quiet.keys() == shared.keys()
    assert all(torch.equal(quiet[name], shared[name]) for name in quiet)
