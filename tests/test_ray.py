"""Rollout workers as Ray actors (corun/scale/ray_workers.py) on a local Ray, 2 actors:
they give the same batches as thread workers, a worker killed mid-rollout has its
batch redone (or fails the run with one line, by setting), and Ctrl-C leaves no Ray
process of the run. One Ray cluster serves the module (``rollout.address``), except
for the Ctrl-C test, whose run starts and must clean up its own."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("ray")

import corun
from corun.loop.clock import Clock
from corun.records import checkpoint
from corun.records.events import read_records
from corun.scale.ray_cluster import LocalCluster, restore_auth, use_auth
from corun.scale.ray_workers import RayWorkers
from tests.support.config import make_config
from tests.support.corun_process import CorunRun
from tests.support.loops import step_records
from tests.support.processes import alive, wait_until
from tests.support.state import assert_state_equal
from trainers.lm.grpo import GRPOTrainer

pytestmark = pytest.mark.slow

TINY = {
    "kind": "grpo", "task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1,
    "samples_per_prompt": 4, "eval_size": 16, "truncated_reward": "keep",
}  # fmt: skip
ASYNC = {"concurrency": 3, "workers": 2, "max_staleness": 1, "lane_threads": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray for the module's in-process runs: its own temp dir and auth token."""
    local = LocalCluster(num_cpus=4, timeout_s=120)
    saved = use_auth(local.auth)
    try:
        yield local.address
    finally:
        restore_auth(saved)
        local.stop()


def _config(run_dir: Path, trainer: dict[str, Any], rollout: dict[str, Any], **loop: Any) -> Any:
    return make_config(
        run_dir, trainer, run={"steps": 6}, loop=ASYNC | {"eval_interval": 6} | loop,
        data={"batch_size": 4}, rollout=rollout,
    )  # fmt: skip


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]


def _evals(run_dir: Path) -> list[float]:
    return [r["eval/reward"] for r in read_records(run_dir / "metrics.jsonl")
            if "eval/reward" in r]  # fmt: skip


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return list(read_records(run_dir / "events.jsonl"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_ray_workers_give_the_batches_of_thread_workers(tmp_path: Path, cluster: str) -> None:
    """Under the fixed version schedule each rollout's (index, attempt, version) is set
    by the producer, so Ray actors and thread workers generate the same batches: the
    same losses, rewards and held-out eval reward gain."""
    runs = {}
    for backend in ("thread", "ray"):
        rollout = {"backend": backend, "address": cluster}
        config = _config(tmp_path / backend, TINY, rollout, version_schedule="fixed")
        with anyio.fail_after(120):
            outcome = await corun.run(GRPOTrainer(config), config)
        assert outcome.reason == "done" and outcome.step == 6
        runs[backend] = tmp_path / backend
    thread, ray_ = (_steps(runs[b]) for b in ("thread", "ray"))
    assert [r["step"] for r in ray_] == list(range(1, 7))
    for key in ("train/loss", "rollout/reward_mean"):
        assert [r[key] for r in ray_] == pytest.approx([r[key] for r in thread], abs=1e-6)
    gains = {b: _evals(runs[b])[-1] - _evals(runs[b])[0] for b in runs}
    assert gains["ray"] == pytest.approx(gains["thread"], abs=1e-6)
    started = [e for e in _events(runs["ray"]) if e["event"] == "rollout_workers"]
    assert len(started) == 1 and len(started[0]["pids"]) == 2
    names = [e["event"] for e in _events(runs["ray"])]
    assert names.index("teardown:checkpoints") < names.index("teardown:rollout_workers")
    assert names.index("teardown:rollout_workers") < names.index("teardown:logging")


@pytest.mark.anyio
async def test_worker_killed_mid_rollout_has_its_batch_redone(
    tmp_path: Path, cluster: str, anyio_backend: str
) -> None:
    dying = TINY | {"kind": "tests.support.ray_trainers:DyingGRPO"}
    config = _config(tmp_path, dying, {"backend": "ray", "address": cluster})
    with anyio.fail_after(120):
        outcome = await corun.run(corun.resolve_trainer(dying["kind"])(config), config)
    assert outcome.reason == "done" and outcome.step == 6
    assert (tmp_path / "worker-died").exists()
    lost = [e for e in _events(tmp_path) if e["event"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["index"] == 2 and lost[0]["action"] == "redo", lost
    assert [r["step"] for r in _steps(tmp_path)] == list(range(1, 7))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_fixed_schedule_resume_on_ray_equals_the_straight_run(
    tmp_path: Path, cluster: str
) -> None:
    """A checkpoint under the fixed schedule holds the older weights the schedule still
    asks for (step 2's: versions 1 and 2; slot 2 generates with version 1): the resumed
    run publishes them to the actors too, so it equals the straight run bitwise."""
    rollout = {"backend": "ray", "address": cluster}
    runs = {name: tmp_path / name for name in ("straight", "resumed")}
    configs = {
        name: _config(run_dir, TINY, rollout, version_schedule="fixed", save_interval=2)
        for name, run_dir in runs.items()
    }
    with anyio.fail_after(120):
        await corun.run(GRPOTrainer(configs["straight"]), configs["straight"])
    shutil.copytree(runs["straight"], runs["resumed"])
    for step in (4, 6):  # as if it had stopped after step 2's checkpoint
        shutil.rmtree(checkpoint.step_dir(runs["resumed"], step))
    with anyio.fail_after(120):
        outcome = await corun.run(GRPOTrainer(configs["resumed"]), configs["resumed"])
    assert outcome.reason == "done" and outcome.step == 6
    assert "restore" in [e["event"] for e in _events(runs["resumed"])]
    assert step_records(runs["resumed"]) == step_records(runs["straight"])
    _, straight = checkpoint.read(checkpoint.step_dir(runs["straight"], 6))
    _, resumed = checkpoint.read(checkpoint.step_dir(runs["resumed"], 6))
    assert_state_equal(resumed["trainer"], straight["trainer"])


def test_fixed_schedule_resume_without_the_old_weights_is_refused(tmp_path: Path) -> None:
    """A trainer that keeps no scheduled weights cannot resume a fixed-schedule run on
    Ray workers whose next slots ask for older versions: one line, a config error."""
    config = _config(tmp_path, TINY, {"backend": "ray"}, version_schedule="fixed")
    clock = Clock.start(config.loop, step=2, version=2, cursor=2, trained_ahead=[])
    workers = RayWorkers(object(), config, clock, None, None)  # type: ignore[arg-type]
    with pytest.raises(corun.ConfigError, match=r"resuming needs the weights of versions \[1\]"):
        workers._scheduled_weights()
    fresh = Clock.start(config.loop, step=0, version=0, cursor=0, trained_ahead=[])
    assert RayWorkers(object(), config, fresh, None, None)._scheduled_weights() == {}  # type: ignore[arg-type]


def test_worker_lost_fails_the_run_with_one_line(
    start_corun: Callable[..., CorunRun], cluster: str
) -> None:
    run = start_corun(
        TINY | {"kind": "tests.support.ray_trainers:DyingGRPO"},
        loop=ASYNC, data={"batch_size": 4}, run={"steps": 6},
        rollout={"backend": "ray", "address": cluster, "on_worker_lost": "fail"},
    )  # fmt: skip
    code = run.wait_exit(timeout=120)
    lines = [line for line in run.stderr().splitlines() if line.startswith("corun:")]
    assert code == 1, run.stderr()
    assert "Traceback" not in run.stderr()
    assert len(lines) == 1 and "died during batch 2" in lines[0], run.stderr()
    assert [e["event"] for e in run.events() if e["event"] == "worker_lost"] == ["worker_lost"]


def _session_alive(sid: int) -> list[int]:
    from corun.execution.procs import _session_members

    return [pid for pid in [sid, *_session_members(sid)] if alive(pid)]


def test_ctrl_c_leaves_no_ray_process(start_corun: Callable[..., CorunRun]) -> None:
    """The run's own local cluster: SIGINT → exit 130, teardown in order, and within
    10 s no process of its Ray session (GCS, raylet, agents, actors) is left."""
    run = start_corun(
        TINY, loop=ASYNC, data={"batch_size": 4}, run={"steps": 1000, "backend": "trio"},
        rollout={"backend": "ray"},
    )  # fmt: skip
    run.wait_until("step 2", lambda: "sync" in run.names(), timeout=120)
    started = next(e for e in run.events() if e["event"] == "rollout_workers")
    run.send(signal.SIGINT)
    code = run.wait_exit()
    assert code == 130, run.stderr()
    assert "Traceback" not in run.stderr()
    names = run.names()
    assert names[-1] == "end" and run.events()[-1]["reason"] == "interrupted"
    assert names.index("teardown:rollout_workers") < names.index("teardown:logging")
    _assert_no_ray_left(started)


def _assert_no_ray_left(started: dict[str, Any]) -> None:
    """Within 10 s, no process of the run's Ray session (nor any of its actors)."""

    def left() -> list[int]:
        return _session_alive(started["cluster_pid"]) + [p for p in started["pids"] if alive(p)]

    wait_until(lambda: not left(), 10, poll_s=0.1)
    remaining = left()
    assert not remaining, f"Ray processes of the run left: {remaining}"


@pytest.mark.parametrize("how", ["third signal", "hard deadline", "SIGKILL"])
def test_a_hard_exit_leaves_no_ray_process(start_corun: Callable[..., CorunRun], how: str) -> None:
    """The run's update hangs, so its teardown never reaches ``rollout_workers``: the
    third SIGINT and ``run.hard_deadline_s`` (both through ``procs.kill_all``), and a
    SIGKILL of corun itself (the parent watch the cluster's head runs under), still end
    the run's whole Ray session within 10 s, and its temp dir goes too."""
    run = start_corun(
        TINY | {"kind": "tests.support.ray_trainers:HangingGRPO"},
        loop=ASYNC, data={"batch_size": 4},
        run={"steps": 1000, "hard_deadline_s": 3 if how == "hard deadline" else 120},
        rollout={"backend": "ray"},
    )  # fmt: skip
    run.wait_until("the update to hang", (run.run_dir / "phase-hang").exists, timeout=120)
    started = next(e for e in run.events() if e["event"] == "rollout_workers")
    cmdline = Path(f"/proc/{started['cluster_pid']}/cmdline").read_bytes().split(b"\0")
    temp_dir = Path(next(a for a in cmdline if a.startswith(b"--temp-dir="))[11:].decode())
    if how == "SIGKILL":
        run.proc.kill()
        assert run.wait_exit() == -signal.SIGKILL
    else:
        run.send(signal.SIGINT)
        if how == "third signal":
            run.wait_stderr("again to skip saving")
            run.send(signal.SIGINT)
            run.wait_stderr("skipping optional teardown steps")
            run.send(signal.SIGINT)
        assert run.wait_exit() == 130, run.stderr()
        assert f"corun: {how}: exiting now" in run.stderr(), run.stderr()
        assert "teardown:rollout_workers" not in run.names()  # Ray was not stopped in order
        assert run.events()[-1]["reason"] == "killed"
    _assert_no_ray_left(started)
    assert temp_dir.is_dir() is False, f"{temp_dir} left"
