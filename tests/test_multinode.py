"""Several nodes under torchrun, as a user launches them: ``corun train CONFIG
run.nnodes=2 run.node_rank=K run.rdzv_endpoint=HOST:PORT`` on each node. Here the two
"nodes" are two launcher processes on loopback, one rank each (corun/scale/launch.py).

- Two nodes train exactly as two ranks of one node (bitwise: the same ranks, the same
  collectives), checkpoint into the shared run directory, and the run resumes on one
  node (2 → 1 ranks, within the data-parallel tolerance of tests/test_distributed.py).
- SIGINT to either node's launcher stops both: every rank tears down in order, saves,
  exits 130 (the signal is relayed through the rendezvous store); nothing is left.
- A node killed with SIGKILL (launcher, agent and rank) ends the other within the
  collective timeout, exit 1, one line.
- A run directory the nodes do not share (a relative run.dir under each node's own
  working directory: two local disks) is refused on both in one line, exit 2.
- The settings: several nodes without a rendezvous, a node_rank past nnodes: exit 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from corun.execution.procs import free_port
from corun.records import checkpoint
from corun.records.events import read_records
from corun.scale.launch import children
from tests.support.cli import assert_usage_error
from tests.support.processes import REPO, wait_until
from tests.test_distributed import KINDS, STEPS, _assert_same, _tables, _two_ranks

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}


class Node:
    """One node's ``corun train`` launcher, started as a terminal starts a foreground
    job (SIGINT at its default)."""

    def __init__(self, cfg: Path, rank: int, port: int, *extra: str, cwd: Path | None = None):
        self.rank = rank
        self.out = cfg.parent / f"node{rank}-{port}.out"
        command = [
            sys.executable, "-m", "corun", "train", str(cfg), "run.nnodes=2",
            f"run.node_rank={rank}", f"run.rdzv_endpoint=127.0.0.1:{port}", *extra,
        ]  # fmt: skip
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                command, cwd=cwd or cfg.parent, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip

    def processes(self) -> list[int]:
        """The launcher and everything under it (torchrun's agent, the rank)."""
        found, queue = [], [self.proc.pid]
        while queue:
            pid = queue.pop()
            found.append(pid)
            queue += children(pid)
        return found

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.out.read_text()


def two_nodes(cfg: Path, *extra: str, cwds: tuple[Path, Path] | None = None) -> list[Node]:
    port = free_port()
    return [Node(cfg, k, port, *extra, cwd=cwds[k] if cwds else None) for k in (0, 1)]


def write(tables: dict[str, Any], cfg: Path) -> Path:
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(tomli_w.dumps(tables))
    return cfg


def assert_gone(pids: list[int]) -> None:
    def alive() -> list[int]:
        return [pid for pid in pids if Path(f"/proc/{pid}").exists()]

    wait_until(lambda: not alive(), 10.0)
    assert not alive(), f"processes of the run left: {alive()}"


def test_two_nodes_train_as_one_and_resume_on_one(tmp_path: Path) -> None:
    grpo = KINDS["grpo"][1]
    one_node = tmp_path / "one-node" / "run"
    _two_ranks(_tables(grpo, one_node), write({}, tmp_path / "one-node" / "cfg.toml"))
    run_dir = tmp_path / "two-nodes" / "run"
    nodes = two_nodes(write(_tables(grpo, run_dir), tmp_path / "two-nodes" / "cfg.toml"))
    assert [node.wait() for node in nodes] == [0, 0], [n.output() for n in nodes]
    _assert_same(run_dir, one_node, exact=True)
    assert [p.name for _, p in checkpoint.list_checkpoints(run_dir)] == ["step-2", "step-4"]
    # Resumed on one node (one rank) to twice the steps: it continues from step 4.
    tables = _tables(grpo, run_dir, steps=2 * STEPS)
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(write(tables, tmp_path / "resume.toml"))],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(1, 2 * STEPS + 1))


def long_run(tmp_path: Path, **run: Any) -> tuple[list[Node], Path]:
    """Two nodes on a long SFT run, once a step has been trained."""
    run_dir = tmp_path / "run"
    tables = _tables(KINDS["sft"][1], run_dir, steps=100_000)
    tables["run"].update(run)
    nodes = two_nodes(write(tables, tmp_path / "cfg.toml"))
    wait_until(lambda: any(r.get("event") == "step" for r in _events(run_dir)), 120.0)
    return nodes, run_dir


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return read_records(path) if path.exists() else []


@pytest.mark.parametrize("signalled", [0, 1])
def test_sigint_to_one_node_stops_both(tmp_path: Path, signalled: int) -> None:
    nodes, run_dir = long_run(tmp_path)
    pids = [pid for node in nodes for pid in node.processes()]
    nodes[signalled].proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    codes = [node.wait(60) for node in nodes]
    assert codes == [130, 130], [n.output() for n in nodes]
    assert time.monotonic() - started < 30
    for node in nodes:
        assert "Traceback" not in node.output(), node.output()
    end = _events(run_dir)[-1]
    assert (end["event"], end["reason"], end["signal"]) == ("end", "interrupted", "SIGINT")
    assert "teardown:save" in {e["event"] for e in _events(run_dir)}
    assert checkpoint.latest(run_dir) is not None  # saved on interrupt, by both ranks
    assert_gone(pids)


def test_a_killed_node_ends_the_other(tmp_path: Path) -> None:
    nodes, _ = long_run(tmp_path, collective_timeout_s=30)
    survivor, lost = nodes
    pids = survivor.processes()
    started = time.monotonic()
    for pid in lost.processes():  # the whole node: launcher, agent, rank
        os.kill(pid, signal.SIGKILL)
    assert survivor.wait(60) == 1, survivor.output()
    assert time.monotonic() - started < 30
    errors = [line for line in survivor.output().splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("corun: error: rank 0: "), errors
    assert "Traceback" not in survivor.output()
    lost.wait(10)
    assert_gone(pids)


def test_a_run_dir_the_nodes_do_not_share_is_refused(tmp_path: Path) -> None:
    tables = _tables(KINDS["sft"][1], Path("run"))  # relative: each node's own disk
    cfg = write(tables, tmp_path / "cfg.toml")
    cwds = (tmp_path / "disk0", tmp_path / "disk1")
    for cwd in cwds:
        cwd.mkdir()
    nodes = two_nodes(cfg, cwds=cwds)
    codes = [node.wait() for node in nodes]
    assert codes == [2, 2], [n.output() for n in nodes]
    for node in nodes:
        lines = [line for line in node.output().splitlines() if line.startswith("corun: error")]
        assert len(lines) == 1, node.output()
        assert "`$.run.dir` = 'run': node 1 (" in lines[0], lines[0]
        assert "does not see what node 0 writes there" in lines[0]
    assert not (cwds[0] / "run" / "checkpoints").exists()
    assert not list((cwds[0] / "run").glob(".corun-nodes-*"))  # the marker is gone


@pytest.mark.parametrize(
    ("extra", "place"),
    [(("run.nnodes=2",), "`$.run`"), (("run.nnodes=2", "run.node_rank=2",
      "run.rdzv_endpoint=127.0.0.1:1"), "`$.run`")],
    ids=["no rendezvous", "node_rank past nnodes"],
)  # fmt: skip
def test_node_settings_are_checked(tmp_path: Path, extra: tuple[str, ...], place: str) -> None:
    cfg = write(_tables(KINDS["sft"][1], tmp_path / "run"), tmp_path / "cfg.toml")
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg), *extra],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_usage_error(done.returncode, done.stderr, place)
    assert not (tmp_path / "run").exists()
