"""Deadlines on the user's code a run waits on (corun/loop/deadlines.py): an evaluation
(``run.eval_timeout_s``), a data source's batch (``run.data_timeout_s``), a checkpoint
write (``checkpoint.write_timeout_s``) and each reward function call
(``run.reward_timeout_s``, through corun/contract/user_calls.py). Each overrun, in a
real run on asyncio and trio, fails it with one line naming what overran and the
setting, teardown runs in order and ``end`` records the line.

The overruns come from tests/support/faults.py's ``slow`` action with a long ``slow_s``:
a sleep in the hook's thread that ignores cancellation, as a hung call does, and that
ends by itself a little after the test. (Environment steps: tests/test_faults.py.)
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.execution import compute
from corun.loop.deadlines import DeadlineError
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support import faults
from tests.support.config import make_config
from tests.support.corun_process import CorunRun, assert_teardown_order
from tests.support.fakes import TEARDOWN_ORDER
from tests.support.faults import Fault, Phase
from trainers.hf.rewards import Rewards

pytestmark = pytest.mark.anyio

FAST = 0.5  # a deadline, s
STUCK_S = 4.0  # how long a "hung" call sleeps: past the deadline and its grace
HF = {
    "kind": "tests.support.faults:FaultyGRPO", "model": "tiny-llama", "samples_per_prompt": 2,
    "max_new_tokens": 4, "eval_size": 4, "rewards": {"tests.support.faults:reward": 1.0},
}  # fmt: skip
HF_TEARDOWN = [n for n in TEARDOWN_ORDER if n != "teardown:weight_sync"]


@pytest.fixture(autouse=True)
def release_hangs() -> Iterator[None]:
    yield
    faults.release_all()


def stuck(phase: Phase, step: int) -> Fault:
    return Fault(phase=phase, step=step, action="slow", slow_s=STUCK_S)


async def fails_with_one_line(config: corun.Config, error: type[Exception], line: str) -> None:
    """The run raises ``error`` with ``line``; teardown ran in order; ``end`` says so."""
    trainer = corun.resolve_trainer(config.trainer.kind)(config)
    with anyio.fail_after(60), pytest.raises(error) as raised:
        await corun.run(trainer, config)
    assert re.fullmatch(line, str(raised.value)), str(raised.value)
    records = read_records(config.run_dir / "events.jsonl")
    order = HF_TEARDOWN if "GRPO" in config.trainer.kind else TEARDOWN_ORDER
    assert [r["event"] for r in records if r["event"].startswith("teardown:")] == order
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "error"
    assert records[-1]["error"] == f"{error.__name__}: {raised.value}"


def fake(run_dir: Path, fault: Fault, **sections: Any) -> corun.Config:
    trainer = {"kind": "tests.support.faults:FaultyFake", "faults": faults.spec(fault)}
    return make_config(run_dir, trainer, run={"steps": 4, **sections.pop("run", {})}, **sections)


@pytest.mark.parametrize(
    ("fault", "loop", "line"),
    [
        (stuck("eval", 1), {}, r"the baseline evaluation did not finish within 0.5 s "),
        (stuck("eval", 2), {"eval_interval": 1}, r"the evaluation after step 1 did not finish "),
    ],
    ids=["baseline", "periodic"],
)
async def test_stuck_evaluation_fails_at_its_deadline(
    tmp_path: Path, anyio_backend: str, fault: Fault, loop: dict[str, Any], line: str
) -> None:
    """The trainer's eval hook sleeps in the train lane's thread: abandoned there."""
    config = fake(tmp_path / "run", fault, loop=loop, run={"eval_timeout_s": FAST})
    await fails_with_one_line(config, DeadlineError, re.escape(line) + r".*\(run\.eval_timeout_s\)")
    assert any(t.name == "corun-lane-train" for t in compute.abandoned_threads())


@pytest.mark.parametrize("loop", [{}, {"concurrency": 2, "workers": 2}], ids=["sync", "async"])
async def test_stuck_data_source_fails_at_its_deadline(
    tmp_path: Path, anyio_backend: str, loop: dict[str, Any]
) -> None:
    """The dataset's ``batch`` sleeps in a rollout lane's thread (at concurrency 1, the
    train lane's); at concurrency 2 the other worker's batches go on meanwhile."""
    config = fake(tmp_path / "run", stuck("data", 2), loop=loop, run={"data_timeout_s": FAST})
    line = r"the data source's batch \d did not finish within 0.5 s \(run\.data_timeout_s\)"
    await fails_with_one_line(config, DeadlineError, line)


async def test_stuck_checkpoint_write_keeps_the_previous_one(
    tmp_path: Path, anyio_backend: str
) -> None:
    """step-4's write hangs inside torch.save: the run fails as after a full disk, and
    step-2 is the latest checkpoint and loads."""
    run_dir = tmp_path / "run"
    config = fake(run_dir, stuck("checkpoint", 2), loop={"save_interval": 2},
                  checkpoint={"write_timeout_s": FAST})  # fmt: skip
    line = (
        "checkpoint step-4 not written (did not finish within 0.5 s: "
        "checkpoint.write_timeout_s); step-2 is intact (resume from it with checkpoint.resume=true)"
    )
    await fails_with_one_line(config, checkpoint.WriteError, re.escape(line))
    latest = checkpoint.latest(run_dir)
    assert latest is not None and latest.name == "step-2"
    assert checkpoint.read(latest)[0].step == 2


@pytest.mark.slow
async def test_stuck_reward_function_names_the_prompt(tmp_path: Path, anyio_backend: str) -> None:
    """hf_grpo's reward function sleeps on its 3rd sample, in the rollout lane's thread."""
    config = make_config(
        tmp_path / "run", {**HF, "faults": faults.spec(stuck("reward", 3))},
        run={"steps": 2, "reward_timeout_s": FAST}, loop={"baseline_eval": False},
        data={"batch_size": 2},
    )  # fmt: skip
    line = (
        r'reward function tests\.support\.faults:reward for prompt "[^"]{1,80}" '
        r"did not finish within 0\.5 s \(run\.reward_timeout_s\)"
    )
    await fails_with_one_line(config, DeadlineError, line)


# ----------------------------------------------------------------------------- reward calls

RELEASE = threading.Event()


def blocking_reward(*, response: str, **_: Any) -> float:
    """Hangs on the reply "stuck" (until the test ends), like a judge that never answers."""
    if response == "stuck":
        RELEASE.wait()
    return 1.0


async def sleepy_reward(*, response: str, **_: Any) -> float:
    if response == "stuck":
        await anyio.sleep(30)
    return 1.0


@pytest.mark.parametrize("function", ["blocking_reward", "sleepy_reward"])
async def test_each_reward_call_has_a_deadline(anyio_backend: str, function: str) -> None:
    """A plain function's calls run in one lane call, watched one by one; the hung one
    is named, with its prompt cut to 80 characters, and its thread is abandoned."""
    rewards = Rewards({f"tests.test_user_deadlines:{function}": 1.0}, "rewards", timeout_s=0.3)
    lane = compute.Lane("rewards")
    prompt = "What is 3+4? " + "and then some " * 10
    RELEASE.clear()
    try:
        with anyio.fail_after(10):
            scores = await rewards.score(["a", "b"], ["7", "7"], ["7", "7"], lane.run)
            assert scores.rewards == [1.0, 1.0]
            with pytest.raises(DeadlineError) as raised:
                await rewards.score(["a", prompt], ["7", "stuck"], ["7", "7"], lane.run)
            assert await lane.run(lambda: 7) == 7  # the lane goes on, on a fresh thread
    finally:
        RELEASE.set()
        lane.close()
    shown = '"What is 3+4? and then some and then some and then some and then some and then..."'
    assert str(raised.value) == (
        f"reward function tests.test_user_deadlines:{function} for prompt {shown} "
        "did not finish within 0.3 s (run.reward_timeout_s)"
    )
    assert lane.abandoned == (function == "blocking_reward")


@pytest.mark.slow
def test_cli_stuck_checkpoint_write_exits_1_with_one_line(
    start_corun: Callable[..., CorunRun],
) -> None:
    """``corun train`` whose last write hangs for minutes: one line, exit 1, teardown in
    order, and the process does not wait for the write's stuck (non-daemon) thread."""
    hang = Fault(phase="checkpoint", step=2, action="slow", slow_s=600)
    run = start_corun(
        {"kind": "tests.support.faults:FaultyFake", "faults": faults.spec(hang)},
        ("checkpoint.write_timeout_s=1",), run={"steps": 4}, loop={"save_interval": 2},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert code == 1, run.stderr()
    assert run.stderr().strip().splitlines()[-1] == (
        "corun: error: checkpoint step-4 not written (did not finish within 1 s: "
        "checkpoint.write_timeout_s); step-2 is intact (resume from it with "
        "checkpoint.resume=true)"
    )
    assert "Traceback" not in run.stderr()
    assert_teardown_order(run.names(), complete=True)
    assert run.names()[-1] == "end"
    latest = checkpoint.latest(run.run_dir)
    assert latest is not None and latest.name == "step-2"


def test_deadlines_must_be_positive() -> None:
    for key in ("run.eval_timeout_s", "run.data_timeout_s", "run.reward_timeout_s",
                "checkpoint.write_timeout_s"):  # fmt: skip
        section, name = key.split(".")
        with pytest.raises(corun.ConfigError, match=rf"`\$\.{section}\.{name}`"):
            corun.config_from_dict({"trainer": {"kind": "sft"}, section: {name: 0}})
