"""Lossless async resume (``checkpoint.keep_rollouts``) on ``configs/grpo_async.toml``
with a small model: finished, untrained rollout batches survive the checkpoint and are
trained first after resume; rollouts in flight are generated again.

The run is stopped at a moment it is made to reach on purpose: the update of data
index ``STOP`` waits until the next index's rollout has finished (buffered) and the
one after has started (that one spins until the run is cancelled: in flight), then
itself waits for the stop (cut short). So the checkpoint keeps ``STOP`` and ``STOP +
1``, and ``STOP + 2`` is generated again. ``loop.max_staleness = 2`` lets two
rollouts run ahead of the batch being trained.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
import torch

import corun
from corun.execution.compute import cancel_point
from corun.loop import kept_rollouts
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.fakes import CallLog
from tests.support.loops import step_records
from tests.support.processes import wait_until
from tests.support.state import assert_state_equal
from tests.test_reproducible_async import ASYNC, SMALL
from trainers.lm.grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]
KIND = "tests.test_keep_rollouts:HeldGRPO"
STEPS = 10
STOP = 4
FIXED = [*SMALL, f"trainer.kind={KIND}", "loop.max_staleness=2", f"run.steps={STEPS}"]
WAIT_S = 30.0


class HeldConfig(GRPOConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    stop_at: int = -1  # data index whose update waits as the module docstring says
    inflight: bool = False  # the rollout of stop_at + 2 spins until the run is cancelled
    delays: bool = False  # rollouts first sleep 0-40 ms (timing only)


class HeldGRPO(GRPOTrainer):
    Config = HeldConfig
    config: HeldConfig

    def __init__(self, config: corun.Config) -> None:
        super().__init__(config)
        self.calls = CallLog()
        self.rolled: list[int] = []  # indexes whose rollout finished, in that order
        self._changed = threading.Condition()
        self._delays = random.Random()

    def rollout(self, examples: list[tuple[str, str]], ctx: corun.RolloutContext) -> corun.Batch:
        stop = self.config.stop_at
        if self.config.inflight and ctx.index == stop + 2:
            self._note(lambda: self.calls.append(f"start:{ctx.index}"))
            _spin_until_cancelled()
        if self.config.delays:
            time.sleep(self._delays.uniform(0.0, 0.04))
        batch = super().rollout(examples, ctx)
        self._note(lambda: self.rolled.append(ctx.index))
        return batch

    def prepare(self, batch: corun.Batch) -> Any:
        stop = self.config.stop_at
        if batch.index == stop:
            # Up to 2 s: in completion order the next index may not be admitted yet.
            with self._changed:
                self._changed.wait_for(
                    lambda: (
                        stop + 1 in self.rolled
                        and (not self.config.inflight or f"start:{stop + 2}" in self.calls)
                    ),
                    timeout=2.0,
                )
            (self.run_config.run_dir / "phase-held").touch()
            self.calls.append(f"held:{stop}")
            _spin_until_cancelled()
        self.calls.append(f"train:{batch.index}")
        return super().prepare(batch)

    def _note(self, change: Any) -> None:
        with self._changed:
            change()
            self._changed.notify_all()


def _spin_until_cancelled() -> None:
    """Return never: raise at the lane's cancel point once the run is stopped."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        cancel_point()
        time.sleep(0.002)
    raise TimeoutError("the run was never stopped")


def _config(run_dir: Path, *overrides: str) -> corun.Config:
    return corun.load_config(ASYNC, [*FIXED, f"run.dir={run_dir}", *overrides])


_STRAIGHT: dict[tuple[str, ...], Path] = {}


async def _straight(tmp_path_factory: pytest.TempPathFactory, *overrides: str) -> Path:
    """The uninterrupted run (once per session): what every resumed one must equal."""
    if overrides not in _STRAIGHT:
        run_dir = tmp_path_factory.mktemp("straight") / "run"
        trainer = HeldGRPO(_config(run_dir, *overrides))
        await corun.run(trainer, trainer.run_config)
        _STRAIGHT[overrides] = run_dir
    return _STRAIGHT[overrides]


def _final(run_dir: Path, step: int = STEPS) -> dict[str, Any]:
    path = checkpoint.step_dir(run_dir, step) / "trainer.pt"
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


def _assert_equals_straight(run_dir: Path, straight: Path) -> None:
    ours, theirs = _final(run_dir), _final(straight)
    assert_state_equal(
        {"trainer": ours["trainer"], "kept": ours["kept"]},
        {"trainer": theirs["trainer"], "kept": theirs["kept"]},
    )
    assert step_records(run_dir) == step_records(straight)


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir / "events.jsonl") if r["event"] == name]


async def _interrupted(
    run_dir: Path, *overrides: str, in_order: bool = True, stop_at: int = STOP
) -> HeldGRPO:
    """The first part: stopped while the update of ``stop_at`` waits (see the module
    docstring)."""
    trainer = HeldGRPO(_config(run_dir, f"trainer.stop_at={stop_at}", *overrides))
    control = corun.RunControl()

    async def stop() -> None:
        await trainer.calls.reached(f"held:{stop_at}")
        control.stop("interrupted", signal="SIGINT")

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop)
        outcome = await corun.run(trainer, trainer.run_config, control=control)
    assert outcome.reason == "interrupted"
    if in_order:
        assert outcome.step == stop_at  # its update never happened
    return trainer


async def _resumed(run_dir: Path, *overrides: str) -> HeldGRPO:
    trainer = HeldGRPO(_config(run_dir, *overrides))
    await corun.run(trainer, trainer.run_config)
    return trainer


async def test_kept_batches_make_the_resume_bitwise_exact(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, anyio_backend: str
) -> None:
    keep = ("checkpoint.keep_rollouts=true", "trainer.inflight=true")
    with anyio.fail_after(120):
        straight = await _straight(tmp_path_factory)
        await _interrupted(tmp_path, *keep)
        saved = _final(tmp_path, STOP)  # weights_only: loads without unpickling
        # The batch cut short and the buffered one; STOP + 2 was in flight.
        assert [entry["index"] for entry in saved["rollouts"]] == [STOP, STOP + 1]
        assert saved["rollouts"][1]["data"]["fields"]["rollouts"]["fields"]["logprobs"].numel()
        assert [e["count"] for e in _events(tmp_path, "rollouts_kept")] == [2]
        resumed = await _resumed(tmp_path, "checkpoint.keep_rollouts=true")
    assert [e["indexes"] for e in _events(tmp_path, "rollouts_restored")] == [[STOP, STOP + 1]]
    # Only what was in flight or never started is generated again: no kept batch.
    assert sorted(resumed.rolled) == list(range(STOP + 2, STEPS))
    assert [c for c in resumed.calls if c.startswith("train:")][:3] == [
        f"train:{i}" for i in (STOP, STOP + 1, STOP + 2)
    ]
    _assert_equals_straight(tmp_path, straight)


async def test_a_window_the_teardown_save_goes_back_over_is_kept(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, anyio_backend: str
) -> None:
    """``loop.accumulate = 2``, stopped in the second batch of a window: the save goes
    back to the window's start, so the window's first batch (trained, its gradients
    lost) is kept too, and training it again after resume is exact."""
    acc = ("loop.accumulate=2",)
    keep = ("checkpoint.keep_rollouts=true", *acc)
    stop = STOP + 1  # the second batch of the window [STOP, STOP + 1]
    with anyio.fail_after(120):
        straight = await _straight(tmp_path_factory, *acc)
        await _interrupted(tmp_path, *keep, "trainer.inflight=true", stop_at=stop)
        kept = _final(tmp_path, STOP)["rollouts"]
        assert [entry["index"] for entry in kept] == [STOP, STOP + 1, STOP + 2]
        resumed = await _resumed(tmp_path, *keep)
    assert sorted(resumed.rolled) == list(range(STOP + 3, STEPS))
    _assert_equals_straight(tmp_path, straight)


@pytest.mark.parametrize("first", ["without", "with"], ids=["never-kept", "kept-then-off"])
async def test_without_keep_rollouts_buffered_batches_are_generated_again(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, anyio_backend: str, first: str
) -> None:
    """Today's behaviour, and what a checkpoint with kept batches does when resumed with
    ``keep_rollouts = false``: they are dropped (an event says so) and generated again,
    which the fixed schedule makes exact too."""
    keep = f"checkpoint.keep_rollouts={'true' if first == 'with' else 'false'}"
    with anyio.fail_after(120):
        straight = await _straight(tmp_path_factory)
        await _interrupted(tmp_path, keep, "trainer.inflight=true")
        assert ("rollouts" in _final(tmp_path, STOP)) == (first == "with")
        resumed = await _resumed(tmp_path)
    assert sorted(resumed.rolled) == list(range(STOP, STEPS))  # STOP, STOP + 1 again
    discarded = [e["count"] for e in _events(tmp_path, "rollouts_discarded")]
    assert discarded == ([2] if first == "with" else [])
    assert _events(tmp_path, "rollouts_restored") == []
    _assert_equals_straight(tmp_path, straight)


async def test_free_running_trains_every_index_once(tmp_path: Path, anyio_backend: str) -> None:
    """Completion order, no fixed schedule, random rollout times (so batches overtake
    each other and may be dropped as too stale): across the interruption every data
    index is trained exactly once, and a kept batch is never generated again."""
    free = (
        "loop.version_schedule=free", "loop.order=completion",
        "trainer.delays=true", "checkpoint.keep_rollouts=true",
    )  # fmt: skip
    with anyio.fail_after(120):
        await _interrupted(tmp_path, *free, in_order=False)
        resumed = await _resumed(tmp_path, *free)
    steps = _events(tmp_path, "step")
    assert sorted(e["index"] for e in steps) == list(range(STEPS))
    kept = _events(tmp_path, "rollouts_kept")[0]["indexes"]
    assert STOP in kept  # the batch cut short, at least
    restored = _events(tmp_path, "rollouts_restored")[0]
    assert restored["indexes"] == kept
    after = [e["index"] for e in steps if e["t"] > restored["t"]]
    dropped = {e["index"] for e in _events(tmp_path, "drop") if e["t"] > restored["t"]}
    if not dropped:  # in the order they had finished, before any new rollout
        assert after[: len(kept)] == kept
    # A kept batch is generated again only if it was dropped as too stale after all.
    assert set(kept) & set(resumed.rolled) <= dropped


@pytest.mark.slow
def test_sigint_and_resume_of_a_real_corun_train(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``corun train configs/grpo_async.toml``, Ctrl-C while batches are buffered, then
    ``corun train`` again: the teardown save keeps them and the resumed run equals the
    uninterrupted one bitwise."""
    straight = anyio.run(_straight, tmp_path_factory)
    run_dir = tmp_path / "run"
    common = [*FIXED, f"run.dir={run_dir}", "checkpoint.keep_rollouts=true"]
    first = _corun(tmp_path, [*common, f"trainer.stop_at={STOP}", "trainer.inflight=true"])
    try:
        held = wait_until(
            (run_dir / "phase-held").exists, WAIT_S, poll_s=0.02,
            unless=lambda: first.poll() is not None,
        )  # fmt: skip
        assert held, _stderr(tmp_path)
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=WAIT_S) == 130, _stderr(tmp_path)
    finally:
        if first.poll() is None:
            first.kill()
    assert [e["indexes"] for e in _events(run_dir, "rollouts_kept")] == [[STOP, STOP + 1]]
    second = _corun(tmp_path, common)
    assert second.wait(timeout=120) == 0, _stderr(tmp_path)
    assert [e["count"] for e in _events(run_dir, "rollouts_restored")] == [2]
    _assert_equals_straight(run_dir, straight)


def _corun(tmp_path: Path, overrides: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "corun", "train", str(ASYNC), *overrides],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text(errors="replace")[-3000:]


class Opaque:
    """Not a dataclass: a checkpoint could hold it only by pickling."""


class OpaqueTrainer(corun.Trainer[corun.TrainerConfig]):
    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> corun.Batch:
        return corun.Batch({"ok": torch.zeros(2), "opaque": Opaque()})

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        return {}


async def test_batches_a_checkpoint_cannot_hold_are_refused(
    tmp_path: Path, anyio_backend: str
) -> None:
    config = corun.config_from_dict({
        "run": {"dir": str(tmp_path), "steps": 2}, "log": {"progress": "off"},
        "loop": {"concurrency": 2, "baseline_eval": False},
        "checkpoint": {"keep_rollouts": True},
        "trainer": {"kind": "tests.test_keep_rollouts:OpaqueTrainer"},
    })  # fmt: skip
    with anyio.fail_after(30), pytest.raises(corun.ConfigError) as caught:
        await corun.run(OpaqueTrainer(config), config)
    message = str(caught.value)
    assert "`$.checkpoint.keep_rollouts`" in message
    assert "'tests.test_keep_rollouts:OpaqueTrainer'" in message
    assert "batch.data['opaque'] is a tests.test_keep_rollouts.Opaque" in message


class Pair(NamedTuple):
    left: torch.Tensor
    right: list[str]


@dataclass(frozen=True)
class Nested:
    pairs: tuple[Pair, ...]
    table: dict[int, torch.Tensor | None]
    scale: float


def test_batch_data_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    data = Nested((Pair(torch.arange(3), ["a", "b"]),), {1: torch.ones(2), 2: None}, 0.5)
    encoded = kept_rollouts.encode(data, "batch.data")
    torch.save(encoded, tmp_path / "kept.pt")
    loaded = torch.load(tmp_path / "kept.pt", weights_only=True)
    back = kept_rollouts.decode(loaded)
    assert type(back) is Nested and type(back.pairs[0]) is Pair
    assert back.pairs[0].right == ["a", "b"] and back.scale == 0.5 and back.table[2] is None
    assert torch.equal(back.pairs[0].left, torch.arange(3))
    assert torch.equal(back.table[1], torch.ones(2))
    # A class that is not loaded (or not a dataclass) is never imported or called.
    loaded["type"] = "os:system"
    with pytest.raises(ValueError, match="not a loaded dataclass"):
        kept_rollouts.decode(loaded)
