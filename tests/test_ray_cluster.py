"""Rollout workers on a Ray cluster that is not the run's own (``rollout.address``):
a head and two worker nodes started as separate ``ray start`` processes on loopback,
the workers with the custom resource ``worker`` (corun.scale.ray_cluster.LocalCluster
with ``join``), the head without it.

- ``rollout.resources = {worker = 1}`` puts every actor on a worker node, never the
  head, and the run gives the batches of thread workers (the fixed schedule): the same
  losses and the same held-out reward gain.
- Resources no node offers are refused at start in one line (exit 2), not left pending.
- SIGINT of the run: exit 130; the cluster keeps running (all three nodes alive) and
  no actor of the run is left.
- A worker node's death (its whole ``ray start`` session killed) is survived with
  ``on_worker_lost = "redo"``: its actor's batch is generated again on the other node,
  and the run completes.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("ray")

import corun
from corun.scale.ray_cluster import LocalCluster, restore_auth, use_auth
from tests.support.cli import assert_usage_error
from tests.support.config import make_config
from tests.support.corun_process import CorunRun
from tests.support.processes import alive, wait_until
from tests.test_ray import ASYNC, TINY, _evals, _events, _steps
from trainers.lm.grpo import GRPOTrainer

pytestmark = pytest.mark.slow
PLACED = {"worker": 1.0}


class Cluster:
    """The head (no ``worker``) and two worker nodes, one actor's room each."""

    def __init__(self) -> None:
        self.head = LocalCluster(num_cpus=1, timeout_s=120, resources={"head": 1})
        self.nodes = [
            LocalCluster(num_cpus=1, timeout_s=120, resources=PLACED, join=self.head)
            for _ in range(2)
        ]
        self.address = self.head.address

    def node_resources(self) -> dict[str, dict[str, float]]:
        """Each alive node's id: its resources (asked as a driver of its own)."""
        import ray

        saved = use_auth(self.head.auth)
        try:
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        finally:
            ray.shutdown()
            restore_auth(saved)

    def stop(self) -> None:
        for node in [*self.nodes, self.head]:
            node.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster()
    saved = use_auth(started.head.auth)  # the runs in this process connect with it
    try:
        yield started
    finally:
        restore_auth(saved)
        started.stop()


def _config(run_dir: Path, rollout: dict[str, Any], **loop: Any) -> Any:
    return make_config(
        run_dir, TINY, run={"steps": 6}, loop=ASYNC | {"eval_interval": 6} | loop,
        data={"batch_size": 4}, rollout=rollout,
    )  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_actors_land_on_the_worker_nodes(tmp_path: Path, cluster: Cluster) -> None:
    runs = {}
    for backend in ("thread", "ray"):
        rollout = {"backend": backend, "address": cluster.address, "resources": PLACED}
        config = _config(tmp_path / backend, rollout, version_schedule="fixed")
        with anyio.fail_after(180):
            outcome = await corun.run(GRPOTrainer(config), config)
        assert outcome.reason == "done" and outcome.step == 6
        runs[backend] = tmp_path / backend
    started = next(e for e in _events(runs["ray"]) if e["event"] == "rollout_workers")
    resources = cluster.node_resources()
    assert len(resources) == 3
    assert all(resources[node].get("worker") == 1.0 for node in started["nodes"]), started
    thread, ray_ = (_steps(runs[b]) for b in ("thread", "ray"))
    for key in ("train/loss", "rollout/reward_mean"):
        assert [r[key] for r in ray_] == pytest.approx([r[key] for r in thread], abs=1e-6)
    gains = {b: _evals(runs[b])[-1] - _evals(runs[b])[0] for b in runs}
    assert gains["ray"] == pytest.approx(gains["thread"], abs=1e-6)


def test_resources_no_node_offers_are_refused(
    start_corun: Callable[..., CorunRun], cluster: Cluster
) -> None:
    run = start_corun(
        TINY, loop=ASYNC, data={"batch_size": 4}, run={"steps": 6},
        rollout={"backend": "ray", "address": cluster.address, "resources": {"gpu_node": 1}},
    )  # fmt: skip
    assert_usage_error(run.wait_exit(timeout=120), run.stderr(), "`$.rollout.resources`")
    assert "its nodes' resources: CPU" in run.stderr()


def test_sigint_leaves_the_cluster_running(
    start_corun: Callable[..., CorunRun], cluster: Cluster
) -> None:
    run = start_corun(
        TINY, loop=ASYNC, data={"batch_size": 4}, run={"steps": 1000},
        rollout={"backend": "ray", "address": cluster.address, "resources": PLACED},
    )  # fmt: skip
    run.wait_until("step 2", lambda: "sync" in run.names(), timeout=180)
    started = next(e for e in run.events() if e["event"] == "rollout_workers")
    run.send(signal.SIGINT)
    assert run.wait_exit() == 130, run.stderr()
    assert "Traceback" not in run.stderr()
    wait_until(lambda: not any(alive(pid) for pid in started["pids"]), 10, poll_s=0.1)
    assert not [pid for pid in started["pids"] if alive(pid)], "actors of the run left"
    assert len(cluster.node_resources()) == 3  # the cluster is the user's: it runs on


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_worker_nodes_death_is_survived(tmp_path: Path, cluster: Cluster) -> None:
    """Runs last in the module: it takes a worker node down."""
    rollout = {"backend": "ray", "address": cluster.address, "resources": PLACED}
    config = _config(tmp_path, rollout)
    trainer = GRPOTrainer(config)

    async def kill_a_node_after_a_step() -> None:
        await anyio.to_thread.run_sync(
            wait_until, lambda: any(e["event"] == "step" for e in _read(tmp_path)), 120.0
        )
        await anyio.to_thread.run_sync(cluster.nodes[0].stop)

    with anyio.fail_after(240):
        async with anyio.create_task_group() as group:
            group.start_soon(kill_a_node_after_a_step)
            outcome = await corun.run(trainer, config)
    assert outcome.reason == "done" and outcome.step == 6
    lost = [e for e in _events(tmp_path) if e["event"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["action"] == "redo", lost
    assert [r["step"] for r in _steps(tmp_path)] == list(range(1, 7))


def _read(run_dir: Path) -> list[dict[str, Any]]:
    return _events(run_dir) if (run_dir / "events.jsonl").exists() else []
