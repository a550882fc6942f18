"""Each injected fault (tests/support/faults.py) → the documented behaviour, in real runs:

- a failure (engine start, generation, weight sync, evaluator, data source) → the run
  fails with that error (``corun train``: exit 1, one line naming it), teardown in
  order, no process left;
- a failing checkpoint write → the run fails, the previous checkpoint intact;
- a failing reward function or environment → counted, the run goes on;
- a slow-down anywhere → the run completes with the results of an undisturbed one;
- a hang → cut at its deadline (tests/test_deadlines.py in process; here through
  ``corun train``, where a thread still stuck must not keep the process alive).

In-process runs on asyncio and trio; the ``corun train`` ones are marked slow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.contract.engine import EngineError
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support import faults
from tests.support.config import make_config
from tests.support.corun_process import CorunRun, assert_engine_gone, assert_teardown_order
from tests.support.fakes import TEARDOWN_ORDER
from tests.support.faults import Action, Fault, FaultError
from tests.support.loops import step_records
from tests.support.state import assert_state_equal
from trainers.hf.tiny import built_in

HF = {
    "kind": "tests.support.faults:FaultyGRPO", "model": "tiny-llama", "samples_per_prompt": 2,
    "max_new_tokens": 4, "eval_size": 4, "rewards": {"tests.support.faults:reward": 1.0},
}  # fmt: skip
AGENTIC = {
    "kind": "tests.support.faults:FaultyAgentic", "d_model": 32, "n_heads": 2, "n_layers": 1,
    "samples_per_prompt": 2, "eval_size": 4,
}  # fmt: skip
HF_TEARDOWN = [n for n in TEARDOWN_ORDER if n != "teardown:weight_sync"]
SETUP_TEARDOWN = ["teardown:stop", "teardown:engine", "teardown:logging", "teardown:on_train_end"]


@pytest.fixture(autouse=True)
def release_hangs() -> Iterator[None]:
    yield
    faults.release_all()


def config(run_dir: Path, trainer: dict[str, Any], *fault: Fault, **sections: Any) -> Any:
    """A small run of ``trainer`` with ``fault``s: 3 steps, no baseline eval."""
    run = {"steps": 3, "seed": 3, **sections.pop("run", {})}
    loop = {"baseline_eval": False, **sections.pop("loop", {})}
    data = {"batch_size": 2, **sections.pop("data", {})}
    table = {**trainer, "faults": faults.spec(*fault)} if fault else trainer
    return make_config(run_dir, table, run=run, loop=loop, data=data, **sections)


async def train(cfg: corun.Config) -> Any:
    trainer = corun.resolve_trainer(cfg.trainer.kind)(cfg)
    with anyio.fail_after(60):
        await corun.run(trainer, cfg)
    return trainer


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_records(run_dir / "events.jsonl")


def teardown(run_dir: Path) -> list[str]:
    """The teardown steps of the directory's last run."""
    names = [e["event"] for e in events(run_dir)]
    last = len(names) - 1 - names[::-1].index("start")
    return [n for n in names[last:] if n.startswith("teardown:")]


def metric_sum(run_dir: Path, key: str) -> float:
    return sum(r.get(key, 0.0) for r in read_records(run_dir / "metrics.jsonl"))


# ----------------------------------------------------------------------------- failures

FAKE = {"kind": "tests.support.faults:FaultyFake"}
Failure = tuple[dict[str, Any], Fault, dict[str, Any], type[Exception], list[str]]
FAILURES: dict[str, Failure] = {
    # name: (trainer, fault, loop settings, error type, teardown steps)
    "sync": (FAKE, Fault(phase="sync", step=2), {}, FaultError, TEARDOWN_ORDER),
    "eval": (FAKE, Fault(phase="eval", step=2), {"eval_interval": 1}, FaultError, TEARDOWN_ORDER),
    "data": (FAKE, Fault(phase="data", step=2), {}, FaultError, TEARDOWN_ORDER),
    "hf-engine_start": (HF, Fault(phase="engine_start"), {}, EngineError, SETUP_TEARDOWN),
    "hf-generate": (HF, Fault(phase="generate", step=2), {}, EngineError, HF_TEARDOWN),
    "hf-sync": (HF, Fault(phase="sync", step=2), {}, EngineError, HF_TEARDOWN),
    "hf-eval": (HF, Fault(phase="eval", step=2), {"eval_interval": 1}, FaultError, HF_TEARDOWN),
    "hf-data": (HF, Fault(phase="data", step=2), {}, FaultError, HF_TEARDOWN),
}


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(FAILURES))
async def test_failure_fails_the_run_and_tears_down_in_order(
    tmp_path: Path, anyio_backend: str, name: str
) -> None:
    table, fault, loop, error, order = FAILURES[name]
    run_dir = tmp_path / "run"
    cfg = config(run_dir, table, fault, loop=loop)
    trainer: Any = corun.resolve_trainer(cfg.trainer.kind)(cfg)
    message = f"injected fault: {fault.phase} failed (occurrence {fault.step})"
    with anyio.fail_after(60), pytest.raises(error, match=f"^{re.escape(message)}$"):
        await corun.run(trainer, cfg)
    assert teardown(run_dir) == order
    end = events(run_dir)[-1]
    assert end["event"] == "end" and end["reason"] == "error"
    assert end["error"] == f"{error.__name__}: {message}"
    assert (run_dir / f"fault-{fault.phase}").exists()
    if name == "hf-sync":  # an update that failed half-way: the engine is dead, not used again
        assert not await trainer.engine.health()


@pytest.mark.anyio
async def test_failing_checkpoint_write_keeps_the_previous_one(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A resumed run's write of step-4 hits a full disk inside torch.save: the run fails
    with the write's error, and step-2 is intact and loads."""
    run_dir = tmp_path / "run"
    await train(config(run_dir, FAKE, run={"steps": 2}, loop={"save_interval": 2}))
    cfg = config(run_dir, FAKE, Fault(phase="checkpoint"), run={"steps": 4},
                 loop={"save_interval": 2})  # fmt: skip
    with pytest.raises(checkpoint.WriteError) as failed:
        await train(cfg)
    assert str(failed.value) == (
        "checkpoint step-4 not written (No space left on device); step-2 is intact "
        "(resume from it with checkpoint.resume=true)"
    )
    latest = checkpoint.latest(run_dir)
    assert latest is not None and latest.name == "step-2"
    assert checkpoint.read(latest)[0].step == 2
    assert not list(checkpoint.checkpoints_dir(run_dir).glob(".tmp-*"))
    assert teardown(run_dir) == TEARDOWN_ORDER
    assert events(run_dir)[-1]["reason"] == "error"


@pytest.mark.anyio
async def test_failed_write_leaves_an_overlapping_write_alone(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Writes run in the background and overlap: step-2's is slow, step-4's fails
    meanwhile. Cleaning up after step-4 must not delete step-2's files in progress."""
    run_dir = tmp_path / "run"
    slow_then_full = [
        Fault(phase="checkpoint", step=1, action="slow", slow_s=0.5),
        Fault(phase="checkpoint", step=2),
    ]
    cfg = config(run_dir, FAKE, *slow_then_full, run={"steps": 6}, loop={"save_interval": 2})
    with pytest.raises(checkpoint.WriteError, match=r"^checkpoint step-4 not written"):
        await train(cfg)
    assert checkpoint.read(checkpoint.step_dir(run_dir, 2))[0].step == 2
    assert not checkpoint.step_dir(run_dir, 4).exists()
    assert not list(checkpoint.checkpoints_dir(run_dir).glob(".tmp-*"))


# ----------------------------------------------------------------------------- counted


@pytest.mark.anyio
async def test_failing_reward_is_counted_and_the_run_goes_on(
    tmp_path: Path, anyio_backend: str
) -> None:
    run_dir = tmp_path / "run"
    await train(config(run_dir, HF, Fault(phase="reward", step=3, times=5)))
    assert metric_sum(run_dir, "rollout/reward_failures") == 5
    assert events(run_dir)[-1]["reason"] == "done"
    assert len(step_records(run_dir)) == 3


@pytest.mark.anyio
async def test_env_variable_arms_faults_for_a_stock_kind(
    tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$CORUN_FAULTS reaches the reward function under plain ``hf_grpo``."""
    monkeypatch.setenv(faults.ENV, json.dumps(faults.spec(Fault(phase="reward", times=2))))
    run_dir = tmp_path / "run"
    await train(config(run_dir, {**HF, "kind": "hf_grpo"}))
    assert metric_sum(run_dir, "rollout/reward_failures") == 2
    assert events(run_dir)[-1]["reason"] == "done"


@pytest.mark.anyio
@pytest.mark.parametrize("action", ["raise", "hang"])
async def test_failing_environment_ends_its_episode_not_the_run(
    tmp_path: Path, anyio_backend: str, action: Action
) -> None:
    """An environment step that raises, or hangs in a thread past env.step_timeout_s:
    its episode ends (counted in rollout/env_failures), the others and the run go on."""
    run_dir = tmp_path / "run"
    trainer = {**AGENTIC, "env": {"step_timeout_s": 0.3}}
    await train(config(run_dir, trainer, Fault(phase="env", step=2, times=3, action=action)))
    assert metric_sum(run_dir, "rollout/env_failures") == 3
    assert events(run_dir)[-1]["reason"] == "done"


# ----------------------------------------------------------------------------- slow-downs

SLOW = [
    Fault(phase=phase, step=step, action="slow", slow_s=0.05)  # type: ignore[arg-type]
    for phase, step in [
        ("engine_start", 1), ("generate", 2), ("sync", 2), ("eval", 1), ("reward", 3),
        ("data", 2), ("checkpoint", 1), ("engine_shutdown", 1),
    ]
]  # fmt: skip


@pytest.mark.anyio
async def test_slow_downs_change_nothing(tmp_path: Path, anyio_backend: str) -> None:
    """Every part of an hf_grpo run slowed down once: it completes, with the same
    per-step metrics and bitwise the same weights as an undisturbed run."""
    loop = {"eval_interval": 2, "save_interval": 2}
    plain = await train(config(tmp_path / "plain", HF, loop=loop))
    slowed = await train(config(tmp_path / "slowed", HF, *SLOW, loop=loop))
    assert sorted(f[0] for f in faults.armed().fired) == sorted(f.phase for f in SLOW)
    assert step_records(tmp_path / "slowed") == step_records(tmp_path / "plain")
    evals = [step_records(tmp_path / d, "eval/reward") for d in ("plain", "slowed")]
    assert evals[0] == evals[1] and evals[0]
    assert_state_equal(slowed.policy.state_dict(), plain.policy.state_dict())
    assert events(tmp_path / "slowed")[-1]["reason"] == "done"
    assert checkpoint.read(tmp_path / "slowed" / "checkpoints" / "step-2")[0].step == 2


# ----------------------------------------------------------------------------- corun train


def one_line_error(run: CorunRun, code: int) -> str:
    """Exit 1, and the error as the last line of stderr; that line."""
    stderr = run.stderr()
    assert code == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("corun: error: "), stderr
    return last


def hf_model() -> str:
    return f"hf:{built_in().resolve()}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cli_hung_sync_exits_1_with_one_line(
    start_corun: Callable[..., CorunRun], backend: str
) -> None:
    """FakeTrainer's sync blocks the train lane's thread: exit 1 with one line, teardown
    in order, the engine child gone, and the process ends despite the stuck thread."""
    run = start_corun(
        {"kind": "tests.support.faults:FaultyFake", "spawn_engine": True,
         "faults": faults.spec(Fault(phase="sync", step=2, action="hang"))},
        (f"run.backend={backend}", "run.sync_timeout_s=1"),
        run={"steps": 4},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert one_line_error(run, code) == (
        "corun: error: weight sync to version 2 did not finish within 1 s (run.sync_timeout_s)"
    )
    assert "Traceback" not in run.stderr()
    assert_teardown_order(run.names(), complete=True)
    assert_engine_gone(run)


@pytest.mark.slow
def test_cli_hung_generation_exits_1_with_one_line(start_corun: Callable[..., CorunRun]) -> None:
    run = start_corun(
        {**HF, "model": hf_model(), "engine_options": {"request_timeout_s": 1},
         "faults": faults.spec(Fault(phase="generate", step=2, action="hang"))},
        loop={"baseline_eval": False}, data={"batch_size": 2},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert one_line_error(run, code) == (
        "corun: error: the 'local' engine's generate did not finish within 1 s "
        "(trainer.engine_options.request_timeout_s)"
    )
    assert "Traceback" not in run.stderr()
    assert_teardown_order(run.names(), complete=False)
    assert teardown_steps(run) == HF_TEARDOWN


def teardown_steps(run: CorunRun) -> list[str]:
    return [n for n in run.names() if n.startswith("teardown:")]


@pytest.mark.slow
def test_cli_failing_checkpoint_write(start_corun: Callable[..., CorunRun]) -> None:
    run = start_corun(
        {**FAKE, "spawn_engine": True, "faults": faults.spec(Fault(phase="checkpoint"))},
        ("run.backend=trio",), run={"steps": 2}, loop={"save_interval": 2},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert one_line_error(run, code) == (
        "corun: error: checkpoint step-2 not written (No space left on device); "
        "no earlier checkpoint"
    )
    assert "Traceback" not in run.stderr()
    assert_teardown_order(run.names(), complete=True)
    assert checkpoint.latest(run.run_dir) is None
    assert not list(checkpoint.checkpoints_dir(run.run_dir).glob(".tmp-*"))
    assert_engine_gone(run)


@pytest.mark.slow
def test_cli_failing_evaluator_ends_with_one_line(start_corun: Callable[..., CorunRun]) -> None:
    """A trainer's own error keeps its traceback (it is the trainer's bug), and the
    last line names it."""
    run = start_corun(
        {**FAKE, "spawn_engine": True, "faults": faults.spec(Fault(phase="eval", step=2))},
        loop={"eval_interval": 1},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert one_line_error(run, code) == (
        "corun: error: FaultError: injected fault: eval failed (occurrence 2)"
    )
    assert_teardown_order(run.names(), complete=True)
    assert_engine_gone(run)


@pytest.mark.slow
def test_cli_environment_thread_stuck_does_not_keep_the_process(
    start_corun: Callable[..., CorunRun],
) -> None:
    """An environment step hangs in a worker thread (asyncio's are not daemon threads),
    abandoned at env.step_timeout_s: the run completes, and the process exits 0."""
    run = start_corun(
        {**AGENTIC, "env": {"step_timeout_s": 0.3},
         "faults": faults.spec(Fault(phase="env", step=2, action="hang"))},
        loop={"baseline_eval": False}, data={"batch_size": 2},
    )  # fmt: skip
    code = run.wait_exit(timeout=60)
    assert code == 0, run.stderr()
    assert run.events()[-1]["reason"] == "done"
    assert metric_sum(run.run_dir, "rollout/env_failures") == 1
