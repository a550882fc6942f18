"""Rollout workers as Ray actors (corun/ray_workers.py) on a local Ray, 2 actors:
they give the same batches as thread workers, a worker killed mid-rollout has its
batch redone (or fails the run with one line, by setting), and Ctrl-C leaves no Ray
process of the run. One Ray cluster serves the module (``rollout.address``), except
for the Ctrl-C test, whose run starts and must clean up its own."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("ray")

import corun
from corun.events import read_records
from corun.ray_cluster import LocalCluster, restore_auth, use_auth
from tests.conftest import make_config
from tests.corun_process import CorunRun, _alive
from tests.corun_process import start_corun as start_corun  # the fixture
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
    dying = TINY | {"kind": "tests.ray_trainers:DyingGRPO"}
    config = _config(tmp_path, dying, {"backend": "ray", "address": cluster})
    with anyio.fail_after(120):
        outcome = await corun.run(corun.resolve_trainer(dying["kind"])(config), config)
    assert outcome.reason == "done" and outcome.step == 6
    assert (tmp_path / "worker-died").exists()
    lost = [e for e in _events(tmp_path) if e["event"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["index"] == 2 and lost[0]["action"] == "redo", lost
    assert [r["step"] for r in _steps(tmp_path)] == list(range(1, 7))


def test_worker_lost_fails_the_run_with_one_line(
    start_corun: Callable[..., CorunRun], cluster: str
) -> None:
    run = start_corun(
        TINY | {"kind": "tests.ray_trainers:DyingGRPO"},
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
    from corun.procs import _session_members

    return [pid for pid in [sid, *_session_members(sid)] if _alive(pid)]


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
    deadline = time.monotonic() + 10
    left = _session_alive(started["cluster_pid"]) + [p for p in started["pids"] if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _session_alive(started["cluster_pid"]) + [p for p in started["pids"] if _alive(p)]
    assert not left, f"Ray processes of the run left: {left}"
