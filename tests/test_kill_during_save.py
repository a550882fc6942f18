"""SIGKILL during a checkpoint write, at seeded random byte offsets of ``trainer.pt``.

A real ``corun train`` (SFT with a model large enough that ``trainer.pt`` is ~148 MB,
written in ~0.1-0.2 s on two cores) saves every step. The test watches the
``checkpoints/.tmp-step-N-<pid>/trainer.pt`` of a write grow and SIGKILLs the process
group once it passes the chosen offset (the last offset is the whole file: written,
not yet renamed). Each following ``corun train ... checkpoint.resume=true`` must restore
the newest complete checkpoint (its ``restore`` event), remove the partial directories,
and go on; it is itself killed in its first or second write, and the last one finishes
the step budget. ``CORUN_KILL_SEED`` picks other offsets.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from corun.records import checkpoint
from tests.support.processes import corun_command, events, wait_until
from tests.support.storm_procs import Child, last_run

pytestmark = pytest.mark.slow

KILLS = 4  # the last at the whole file's size
STEPS = 14
WAIT_S = 120.0  # for a complete checkpoint, a write to pass its offset, or a run's end
BIG_SFT = (
    "trainer.d_model=320", "trainer.n_heads=4", "trainer.n_layers=10", "trainer.eval_size=16",
    "data.batch_size=8", f"run.steps={STEPS}", "loop.save_interval=1", "loop.eval_interval=0",
    "loop.baseline_eval=false", "loop.lane_threads=1", "log.progress=off", "checkpoint.keep=3",
)  # fmt: skip


@dataclass
class Kill:
    target: int  # bytes of trainer.pt written when the group is killed
    nth: int  # in the run's n-th write
    seen: int = 0  # its size when the kill was sent (writes come in chunks)
    victim: str = ""  # the temporary directory being written
    writing_s: float = 0.0  # since it appeared
    complete_after: int | None = None  # the newest complete checkpoint after the kill
    partial_after: tuple[str, ...] = ()  # temporary directories left by the kill
    restored: int | None = None  # what the next run restored


def _command(run_dir: Path) -> list[str]:
    config = str(Path(__file__).resolve().parents[1] / "configs" / "sft.toml")
    return [*corun_command(), "train", config, *BIG_SFT, f"run.dir={run_dir}",
            "checkpoint.resume=true"]  # fmt: skip


def _writes(run_dir: Path, pid: int) -> list[Path]:
    return sorted(checkpoint.checkpoints_dir(run_dir).glob(f".tmp-step-*-{pid}/trainer.pt"))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # renamed into place meanwhile
        return -1


def _complete_size(child: Child, run_dir: Path) -> int:
    """The size of a complete trainer.pt: wait for this run's first checkpoint."""
    first = wait_until(
        lambda: checkpoint.latest(run_dir), WAIT_S, poll_s=0.005, unless=child.exited
    )
    assert first or not child.exited(), f"corun exited early:\n{child.stderr()}"
    assert first, "no complete checkpoint"
    return (first / checkpoint.TENSORS_FILE).stat().st_size


def _kill_in_a_write(child: Child, run_dir: Path, kill: Kill) -> None:
    """Poll this process's temporary trainer.pt files; SIGKILL the group when its
    ``kill.nth`` write reaches ``kill.target`` bytes."""
    pid = child.proc.pid
    deadline = time.monotonic() + WAIT_S
    seen: dict[str, float] = {}  # this run's writes, in the order they appeared, and when
    while time.monotonic() < deadline:
        assert child.proc.poll() is None, f"no write passed {kill.target} bytes:\n{child.stderr()}"
        for path in _writes(run_dir, pid):
            name = path.parent.name
            seen.setdefault(name, time.monotonic())
            if list(seen).index(name) + 1 < kill.nth:
                continue
            size = _size(path)
            if size >= kill.target:
                child.watch.kill()  # SIGKILL to the process group
                kill.seen, kill.victim = size, name
                kill.writing_s = time.monotonic() - seen[name]
                child.proc.wait(timeout=30)
                return
        time.sleep(0.0005)
    pytest.fail(f"no write passed {kill.target} bytes in {WAIT_S} s")


def _restored(run_dir: Path) -> int | None:
    found = [r["step"] for r in last_run(events(run_dir)) if r["event"] == "restore"]
    return found[0] if found else None


def test_sigkill_during_checkpoint_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(int(os.environ.get("CORUN_KILL_SEED", 11)))
    fractions = [rng.uniform(0.02, 0.98) for _ in range(KILLS - 1)] + [1.0]
    run_dir = tmp_path / "run"
    command = _command(run_dir)
    kills: list[Kill] = []
    size = 0
    for k, fraction in enumerate(fractions):
        child = Child.start(command, tmp_path / f"run-{k}")
        try:
            size = size or _complete_size(child, run_dir)
            kill = Kill(target=max(1, round(fraction * size)), nth=rng.choice([1, 2]))
            _kill_in_a_write(child, run_dir, kill)
            assert child.watch.wait_gone() == [], "a process outlived SIGKILL of its group"
        finally:
            child.close()
        if kills:  # this run started from the previous kill's newest complete checkpoint
            kills[-1].restored = _restored(run_dir)
        complete = checkpoint.list_checkpoints(run_dir)
        kill.complete_after = complete[-1][0] if complete else None
        partial = checkpoint.checkpoints_dir(run_dir).glob(".tmp-*")
        kill.partial_after = tuple(sorted(p.name for p in partial))
        kills.append(kill)
        for _, path in complete:  # what the kill left complete is whole
            checkpoint.read(path)

    final = Child.start(command, tmp_path / "run-final")
    try:
        code = final.wait(WAIT_S)
        assert code == 0, f"the last resume: exit {code}\n{final.stderr()}"
        assert final.watch.wait_gone() == []
    finally:
        final.close()
    kills[-1].restored = _restored(run_dir)

    with capsys.disabled():
        print(f"\ntrainer.pt: {size:,} bytes; SIGKILL at")
        for kill in kills:
            print(
                f"  {kill.seen:>11,} bytes ({kill.seen / size:4.0%}, "
                f"{kill.writing_s * 1000:4.0f} ms into the write) of {kill.victim}: newest "
                f"complete step-{kill.complete_after}, partial {list(kill.partial_after)}; "
                f"the next run restored step-{kill.restored}"
            )
    for kill in kills:
        assert kill.restored == kill.complete_after, kill
        assert kill.victim in kill.partial_after or kill.seen == size, kill
    # Every run removed the partial directories it found; the last left none.
    assert not list(checkpoint.checkpoints_dir(run_dir).glob(".tmp-*"))
    records = last_run(events(run_dir))
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "done", records[-1]
    state, tensors = checkpoint.read(checkpoint.step_dir(run_dir, STEPS))
    assert state.step == STEPS and "model" in tensors["trainer"]
    # Each resumed run removed the partial directories of the kill before it (at its
    # start), not only the last one.
    for before, after in itertools.pairwise(kills):
        assert not set(before.partial_after) & set(after.partial_after), (before, after)
