"""``corun bench fleet``: the trainer's side of a fleet of engine servers
(corun/engines/fleet.py against ``corun engine serve``, each server its own process on
loopback), and several torchrun nodes against one:

- **sync** to 1, 2 and 3 members (the built-in tiny Llama's state, streamed in buckets
  over HTTP, then every member's fingerprint): time and bytes sent per version;
- **rollout throughput** with 1, 2 and 3 members: generated tokens/s of an hf_grpo run
  with as many rollouts in flight as members, ratios against one member;
- **a member killed mid-run**: an hf_grpo run on 2 members, one SIGKILLed after step 3:
  steps lost, generations retried, the slowest step against the median step;
- **two nodes vs one**: ``corun train sft`` at world size 2 as two loopback nodes of one
  rank each (``run.nnodes = 2``) against one node of two ranks, steps/s.

::

    python -m benchmarks.fleet              # ~3 minutes
    python -m benchmarks.fleet --grid tiny  # the test's, ~1 minute

Nothing is asserted. On one machine the members share its cores (2 here), so more
members add no compute: the throughput ratios show the fleet's overhead and balance,
not the scaling of separate machines. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import Note, Table, fmt, markdown_table
from corun.records.events import read_records

ENV = {**os.environ, "WANDB_MODE": "disabled"}


@dataclass(frozen=True)
class Grid:
    name: str
    members: tuple[int, ...]
    steps: int  # each fleet size's hf_grpo run
    run_steps: int  # the killed-member run
    node_steps: int  # each two-nodes / one-node run


GRIDS = {
    "full": Grid("full", (1, 2, 3), 20, 20, 40),
    "quick": Grid("quick", (1, 2, 3), 8, 12, 20),
    "tiny": Grid("tiny", (1, 2), 3, 6, 6),
}


class Server:
    """``corun engine serve hf_grpo`` (the built-in tiny Llama, the local engine)."""

    def __init__(self, scratch: Path, port: int = 0) -> None:
        self.log = scratch / f"server-{time.monotonic_ns()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corun", "engine", "serve", "hf_grpo",
                 'trainer.init_from=""', f"run.dir={scratch / 'servers'}", f"serve.port={port}"],
                env=ENV, stdout=out, stderr=subprocess.STDOUT, cwd=scratch,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (found := re.findall(r"serving (http://\S+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine server did not start: {self.log.read_text()[-500:]}")
            time.sleep(0.2)
        self.url = found[0]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(30)


def hf_grpo_on(urls: list[str], scratch: Path, name: str, steps: int, *extra: str) -> Path:
    """``corun train hf_grpo`` on the fleet ``urls`` (the built-in tiny Llama, no warm
    start: the figures are of the machinery); its run directory."""
    run_dir = scratch / name
    listed = str(urls).replace("'", '"')
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", "hf_grpo", 'trainer.init_from=""',
         f"run.dir={run_dir}", f"run.steps={steps}", "log.progress=off",
         f"loop.eval_interval={steps}", "trainer.eval_size=16", "trainer.engine=remote",
         f"trainer.engine_options.urls={listed}", *extra],
        env=ENV, cwd=scratch, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"hf_grpo on {len(urls)} member(s) failed: {done.stderr[-500:]}")
    return run_dir


def fleet_figures(urls: list[str], scratch: Path, grid: Grid) -> dict[str, float]:
    """Sync time and bytes, and generated tokens/s with as many rollouts in flight as
    members (16 prompts x 8 samples each)."""
    size = len(urls)
    run_dir = hf_grpo_on(
        urls, scratch, f"members-{size}", grid.steps, f"loop.concurrency={size}",
        f"loop.workers={size}", 'trainer.rollout_correction="none"',
    )  # fmt: skip
    steps = [r for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]
    syncs = [r["perf/sync_time_s"] for r in read_records(run_dir / "metrics.jsonl")
             if "perf/sync_time_s" in r]  # fmt: skip
    times = [e["t"] for e in read_records(run_dir / "events.jsonl") if e["event"] == "step"]
    tokens = sum(r["rollout/response_len_mean"] * 16 * 8 for r in steps[1:])
    return {
        "sync_s": statistics.median(syncs), "mib": steps[-1]["fleet/sync_mib"],
        "tokens_per_s": tokens / (times[-1] - times[0]),
    }  # fmt: skip


def killed_member_run(servers: list[Server], scratch: Path, grid: Grid) -> dict[str, float]:
    """hf_grpo on 2 members, the second SIGKILLed after step 3."""
    run_dir = scratch / "killed"
    urls = str([s.url for s in servers[:2]]).replace("'", '"')
    command = [
        sys.executable, "-m", "corun", "train", "hf_grpo", 'trainer.init_from=""',
        f"run.dir={run_dir}", f"run.steps={grid.run_steps}", "log.progress=off",
        f"loop.eval_interval={grid.run_steps}", "trainer.eval_size=16", "data.batch_size=4",
        "trainer.engine=remote", f"trainer.engine_options.urls={urls}",
    ]  # fmt: skip
    run = subprocess.Popen(command, env=ENV, cwd=scratch, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip

    def stepped() -> int:
        path = run_dir / "events.jsonl"
        return sum(e["event"] == "step" for e in read_records(path)) if path.exists() else 0

    while stepped() < 3 and run.poll() is None:
        time.sleep(0.1)
    servers[1].stop(signal.SIGKILL)
    _, stderr = run.communicate(timeout=900)
    if run.returncode:
        raise RuntimeError(f"the run with a killed member failed: {stderr[-500:]}")
    steps = [r for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]
    times = [e["t"] for e in read_records(run_dir / "events.jsonl") if e["event"] == "step"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "steps": float(len(steps)), "lost": float(grid.run_steps - len(steps)),
        "retried": steps[-1].get("fleet/retried", 0.0),
        "worst_step_s": max(gaps), "median_step_s": statistics.median(gaps),
    }  # fmt: skip


def nodes_run(scratch: Path, nodes: int, steps: int) -> float:
    """``corun train sft`` at world size 2: ``nodes`` launchers; steps/s."""
    from corun.execution.procs import free_port

    run_dir = scratch / f"nodes-{nodes}"
    common = [
        sys.executable, "-m", "corun", "train", "sft", "trainer.task=sort",
        "trainer.d_model=64", "trainer.n_layers=2", "trainer.n_heads=2", "trainer.eval_size=16",
        f"run.dir={run_dir}", f"run.steps={steps}", "loop.baseline_eval=false",
        "data.batch_size=32", "log.progress=off",
    ]  # fmt: skip
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    if nodes == 1:
        launchers = [subprocess.Popen([*common, "run.nproc=2"], env=env, cwd=scratch)]
    else:
        port = free_port()
        launchers = [subprocess.Popen([*common, "run.nnodes=2", f"run.node_rank={k}",
                                       f"run.rdzv_endpoint=127.0.0.1:{port}"], env=env, cwd=scratch)
                     for k in range(2)]  # fmt: skip
    if any(p.wait(900) for p in launchers):
        raise RuntimeError(f"sft at {nodes} node(s) failed")
    times = [e["t"] for e in read_records(run_dir / "events.jsonl") if e["event"] == "step"]
    return float((len(times) - 1) / (times[-1] - times[0]))


def measure(grid: Grid, scratch: Path, note: Note) -> dict[str, Any]:
    note(f"starting {max(grid.members)} engine servers")
    servers = [Server(scratch) for _ in range(max(grid.members))]
    try:
        fleets = {}
        for size in grid.members:  # the first `size` servers
            note(f"{size} member(s): sync and throughput")
            fleets[size] = fleet_figures([s.url for s in servers[:size]], scratch, grid)
        note("a member killed mid-run")
        killed = killed_member_run(servers, scratch, grid)
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)
    note("two nodes against one")
    nodes = {n: nodes_run(scratch, n, grid.node_steps) for n in (1, 2)}
    return {"fleets": fleets, "killed": killed, "nodes": nodes}


def tables(grid: Grid, figures: dict[str, Any]) -> list[Table]:
    fleets, killed, nodes = figures["fleets"], figures["killed"], figures["nodes"]
    one = fleets[min(fleets)]
    rows = [[str(n), fmt(f["sync_s"] * 1e3, 1), fmt(f["mib"], 1), fmt(f["tokens_per_s"], 0)]
            for n, f in fleets.items()]  # fmt: skip
    fleet = Table(
        "fleet", "members", "A fleet of engine servers on loopback: sync and throughput",
        ["members", "sync ms (median; streamed + fingerprints)", "MiB sent per version",
         "generated tokens/s"],
        rows, [(f"{n} members", f["tokens_per_s"] / one["tokens_per_s"])
               for n, f in fleets.items()],
        "one member's tokens/s",
        [f"hf_grpo for {grid.steps} steps with as many rollouts in flight as members, "
         "16 prompts x 8 samples each; the members share this machine's cores, so more "
         "members add no compute here."],
    )  # fmt: skip
    recovery = Table(
        "fleet", "killed", "A member SIGKILLed after step 3 of an hf_grpo run on 2 members",
        ["steps run", "steps lost", "generations retried", "slowest step s", "median step s"],
        [[fmt(killed["steps"], 0), fmt(killed["lost"], 0), fmt(killed["retried"], 0),
          fmt(killed["worst_step_s"], 2), fmt(killed["median_step_s"], 2)]],
        [("slowest step", killed["worst_step_s"] / killed["median_step_s"])], "the median step",
    )  # fmt: skip
    node = Table(
        "fleet", "nodes", "World size 2: two loopback nodes of one rank against one node of two",
        ["layout", "steps/s"],
        [["one node, 2 ranks", fmt(nodes[1], 2)], ["two nodes, 1 rank each", fmt(nodes[2], 2)]],
        [("two nodes", nodes[2] / nodes[1])], "one node of two ranks",
    )  # fmt: skip
    return [fleet, recovery, node]


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench fleet``."""
    settings = GRIDS[grid]
    return tables(settings, measure(settings, scratch, note))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=GRIDS, default="full")
    args = parser.parse_args(argv)
    settings = GRIDS[args.grid]
    with tempfile.TemporaryDirectory(prefix="corun-bench-fleet-") as scratch:
        figures = measure(settings, Path(scratch), lambda text: print(
            f"[fleet] {text}", file=sys.stderr, flush=True))  # fmt: skip
    for table in tables(settings, figures):
        print("\n".join(markdown_table(table, plot=False)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
