"""Bounded weight syncs and engine calls (corun/loop/deadlines.py), in real runs on asyncio
and trio: a sync, an engine start, a generation or an engine shutdown that hangs in a
thread (ignoring cancellation, as a hung C call does) is cancelled at its deadline,
the stuck call is abandoned, the run fails with one line naming what overran and the
setting, and teardown runs in order. The hangs come from tests/support/faults.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.contract.engine import EngineError, Sampling
from corun.engines.options import EngineOptions
from corun.engines.start import check_engine
from corun.execution import compute
from corun.loop.deadlines import BoundedEngine, DeadlineError, deadline
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support import faults
from tests.support.config import make_config
from tests.support.fakes import TEARDOWN_ORDER
from tests.support.faults import Fault, FaultyFake

pytestmark = pytest.mark.anyio

HF = {
    "kind": "tests.support.faults:FaultyGRPO", "model": "tiny-llama", "samples_per_prompt": 2,
    "max_new_tokens": 4, "eval_size": 4, "rewards": {"tests.support.faults:reward": 1.0},
}  # fmt: skip
HF_TEARDOWN = [n for n in TEARDOWN_ORDER if n != "teardown:weight_sync"]  # no channel of its own
FAST = 0.5  # a deadline, s: the hang ends after it plus the grace (as long again)


@pytest.fixture(autouse=True)
def release_hangs() -> Iterator[None]:
    yield
    faults.release_all()


def fake_config(run_dir: Path, *fault: Fault, **sections: Any) -> corun.Config:
    trainer = {"kind": "tests.support.faults:FaultyFake", "faults": faults.spec(*fault)}
    run = {"steps": 4, "sync_timeout_s": FAST, **sections.pop("run", {})}
    return make_config(run_dir, trainer, run=run, **sections)


def hf_config(run_dir: Path, *fault: Fault, options: Any = None, **sections: Any) -> corun.Config:
    trainer = {**HF, "faults": faults.spec(*fault), "engine_options": options or {}}
    run = {"steps": 3, "seed": 3, **sections.pop("run", {})}
    loop = {"baseline_eval": False, **sections.pop("loop", {})}
    return make_config(run_dir, trainer, run=run, loop=loop, data={"batch_size": 2}, **sections)


async def run_failing(config: corun.Config, error: type[BaseException], match: str) -> Any:
    trainer = corun.resolve_trainer(config.trainer.kind)(config)
    with anyio.fail_after(60), pytest.raises(error, match=match):
        await corun.run(trainer, config)
    return trainer


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_records(run_dir / "events.jsonl")


def teardown(run_dir: Path) -> list[str]:
    return [e["event"] for e in events(run_dir) if e["event"].startswith("teardown:")]


def assert_failed(run_dir: Path, order: list[str], error: str) -> None:
    records = events(run_dir)
    assert teardown(run_dir) == order
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "error", records[-1]
    assert records[-1]["error"] == f"DeadlineError: {error}"


# ----------------------------------------------------------------------------- the lane


async def test_deadline_abandons_a_stuck_lane_call(anyio_backend: str) -> None:
    """A call that ignores cancellation is left to its thread; the call queued behind it
    runs on a fresh thread, and the lane goes on serving."""
    lane = compute.Lane("stuck")
    release = threading.Event()
    ran_on: list[str] = []

    async def queued() -> None:
        ran_on.append(await lane.run(lambda: threading.current_thread().name))

    try:
        with anyio.fail_after(10):
            # The thread serving first: its start-up (preload.py) could outlast 0.2 s, and
            # a call that never started is not abandoned but never run.
            await lane.run(lambda: None)
            async with anyio.create_task_group() as tg:
                with pytest.raises(
                    DeadlineError, match=r"^the call did not finish within 0.2 s \(x\)$"
                ):
                    with deadline("the call", 0.2, "x"):
                        tg.start_soon(queued)
                        await lane.run(release.wait)
            assert lane.abandoned == 1
            stuck = compute.abandoned_threads()
            assert stuck and stuck[-1].name == "corun-lane-stuck"
            assert ran_on == ["corun-lane-stuck"] and threading.current_thread().name not in ran_on
            assert await lane.run(lambda: 7) == 7
    finally:
        release.set()
        lane.close()


async def test_without_a_deadline_cancellation_still_waits_for_the_call(
    anyio_backend: str,
) -> None:
    """Outside a deadline a cancelled call is never abandoned (it may hold tensors)."""
    lane = compute.Lane("patient")
    with anyio.fail_after(10):
        with anyio.move_on_after(0.1):
            await lane.run(lambda: threading.Event().wait(0.5))
        assert lane.abandoned == 0
    lane.close()


def test_the_local_engine_takes_the_deadline_options() -> None:
    check_engine("local", EngineOptions(start_timeout_s=1, request_timeout_s=2), False)
    check_engine("local", EngineOptions(shutdown_timeout_s=3), False)
    check_engine("local", EngineOptions(max_num_seqs=3), False)  # its rows batched at once
    with pytest.raises(corun.ConfigError, match=r"engine_options\.kv_cache_gib"):
        check_engine("local", EngineOptions(kv_cache_gib=3), False)


# ----------------------------------------------------------------------------- the sync


@pytest.mark.parametrize("loop", [{}, {"concurrency": 3, "workers": 2}], ids=["sync", "async"])
async def test_hung_sync_hook_fails_at_its_deadline(
    tmp_path: Path, anyio_backend: str, loop: dict[str, Any]
) -> None:
    """FakeTrainer's plain sync_weights blocks the train lane's thread at version 2."""
    run_dir = tmp_path / "run"
    error = "weight sync to version 2 did not finish within 0.5 s (run.sync_timeout_s)"
    trainer = await run_failing(
        fake_config(run_dir, Fault(phase="sync", step=2, action="hang"), loop=loop),
        DeadlineError, f"^{error}$".replace("(", r"\(").replace(")", r"\)"),
    )  # fmt: skip
    assert_failed(run_dir, TEARDOWN_ORDER, error)
    assert trainer.calls[-1] == "on_train_end:error"
    assert [e["version"] for e in events(run_dir) if e["event"] == "sync"] == [1]
    assert any(t.name == "corun-lane-train" for t in compute.abandoned_threads())


async def test_stop_during_a_hung_sync_abandons_it_and_saves(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A stop (SIGINT's) while a sync hangs in the train lane's thread: the call is
    abandoned after its grace (min(deadline, 5 s)) rather than waited on until the hard
    deadline, and teardown runs in full, the save on interrupt included (step 2 was
    trained). The stop comes first: the run is interrupted, not failed."""
    run_dir = tmp_path / "run"
    config = fake_config(run_dir, Fault(phase="sync", step=2, action="hang"),
                         run={"sync_timeout_s": 2.0})  # fmt: skip
    trainer = FaultyFake(config)
    control = corun.RunControl()

    async def stop_when_hung() -> None:
        await faults.fired("sync")
        control.stop("interrupted", signal="SIGINT")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_hung)
            outcome = await corun.run(trainer, config, control=control)
    assert outcome.reason == "interrupted"
    assert teardown(run_dir) == TEARDOWN_ORDER
    latest = checkpoint.latest(run_dir)
    assert latest is not None and checkpoint.read(latest)[0].step == 2
    assert trainer.calls[-1] == "on_train_end:interrupted"


@pytest.mark.parametrize("loop", [{}, {"concurrency": 2}], ids=["sync", "async"])
async def test_hung_engine_update_fails_the_sync(
    tmp_path: Path, anyio_backend: str, loop: dict[str, Any]
) -> None:
    """The engine's update_weights hangs on its lane (at concurrency 2 the engine's
    own, generations queued behind it): the loop's sync deadline cuts it, and the
    engine, its weights now unknown, is dead."""
    run_dir = tmp_path / "run"
    config = hf_config(run_dir, Fault(phase="sync", step=2, action="hang"),
                       run={"sync_timeout_s": FAST}, loop=loop)  # fmt: skip
    trainer = await run_failing(config, DeadlineError, "weight sync to version 2 did not finish")
    assert_failed(
        run_dir, HF_TEARDOWN,
        "weight sync to version 2 did not finish within 0.5 s (run.sync_timeout_s)",
    )  # fmt: skip
    engine = trainer.engine
    assert isinstance(engine, BoundedEngine)
    assert not await engine.health()
    assert engine.dead == "its weight update to version 2 did not complete"


async def test_hung_generation_fails_at_the_request_deadline(
    tmp_path: Path, anyio_backend: str
) -> None:
    run_dir = tmp_path / "run"
    config = hf_config(run_dir, Fault(phase="generate", step=2, action="hang"),
                       options={"request_timeout_s": FAST})  # fmt: skip
    trainer = await run_failing(config, DeadlineError, "engine's generate did not finish")
    error = (
        "the 'local' engine's generate did not finish within 0.5 s "
        "(trainer.engine_options.request_timeout_s)"
    )
    assert_failed(run_dir, HF_TEARDOWN, error)
    assert not await trainer.engine.health()
    with anyio.fail_after(5), pytest.raises(EngineError, match="unusable: the 'local'"):
        await trainer.engine.generate([[1]], Sampling(max_tokens=1), 0)


async def test_hung_engine_start_fails_at_its_deadline(tmp_path: Path, anyio_backend: str) -> None:
    run_dir = tmp_path / "run"
    config = hf_config(run_dir, Fault(phase="engine_start", action="hang"),
                       options={"start_timeout_s": FAST})  # fmt: skip
    await run_failing(config, DeadlineError, "engine's start did not finish")
    names = [e["event"] for e in events(run_dir)]
    assert "setup" not in names  # the trainer's setup never finished
    # What set-up had registered is torn down, the engine included, in order.
    assert teardown(run_dir) == [
        "teardown:stop", "teardown:engine", "teardown:logging", "teardown:on_train_end"
    ]  # fmt: skip
    assert events(run_dir)[-1]["error"].endswith("(trainer.engine_options.start_timeout_s)")


async def test_hung_engine_shutdown_is_cut_and_teardown_goes_on(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Training is done; the engine's shutdown hangs: it is given up on at its deadline
    (an error: the run exits 1), and logging and on_train_end still run."""
    run_dir = tmp_path / "run"
    config = hf_config(run_dir, Fault(phase="engine_shutdown", action="hang"),
                       options={"shutdown_timeout_s": FAST})  # fmt: skip
    await run_failing(config, DeadlineError, "engine's shutdown did not finish within 0.5 s")
    records = {e["event"]: e for e in events(run_dir)}
    assert teardown(run_dir) == HF_TEARDOWN
    assert records["teardown:engine"]["status"] == "error"
    assert "trainer.engine_options.shutdown_timeout_s" in records["teardown:engine"]["error"]
    assert records["teardown:logging"]["status"] == records["teardown:on_train_end"]["status"]
    assert records["teardown:logging"]["status"] == "ok"
    assert records["end"]["step"] == 3  # every step was trained
