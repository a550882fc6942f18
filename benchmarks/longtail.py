"""``corun bench longtail``: synchronous against asynchronous training on long-tailed
generations, with weight updates that drain and ones that go in flight.

The job: ``hf_grpo`` with generation lengths drawn heavy-tailed, most rows short and a
few 10–25 times longer (benchmarks/longtail_job.py: the recipe's policy, reward and
update, only the generation's cost has the tail). Each engine (``local``, ``vllm``)
runs three modes, each a fresh ``corun train`` in one scratch folder (the SFT warm
start trained once there), the same steps and seed:

- sync: ``loop.concurrency = 1`` (generation and updates alternate);
- async, drain: 2 rollout workers, staleness 1, ``rollout_correction = "token-tis"``; a
  weight sync waits for every running generation;
- async, in flight: the same with ``inflight_at_sync = "interrupt"``: the new weights
  are taken between two decode steps (vLLM: ``kv_at_switch = "keep"``).

Figures per run: generated tokens/s and steps/s over its training time (evaluations
excluded), the mean time a sync took, the generators' idle share, the mean staleness,
and the held-out reward at the same wall time for every mode (the last evaluation
within the shortest run's training time).

::

    python -m benchmarks.longtail           # 40 steps each, both engines
    python -m benchmarks.longtail --quick   # 12 steps each

Nothing is asserted; measure on a quiet machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from benchmarks.peers import ENV, training_curve
from benchmarks.report import Note, Table, fmt
from benchmarks.suite import main_of
from corun.records.events import read_records

JOB = "benchmarks.longtail_job:LongTailGRPO"
ASYNC = ("loop.concurrency=3", "loop.workers=2", "loop.max_staleness=1",
         "trainer.rollout_correction=token-tis")  # fmt: skip
MODES = {  # name: overrides
    "sync": (),
    "async, drain": ASYNC,
    "async, in flight": (*ASYNC, "trainer.inflight_at_sync=interrupt"),
}


@dataclass(frozen=True)
class Grid:
    engines: tuple[str, ...]
    steps: int
    eval_every: int
    eval_size: int


GRIDS = {
    "full": Grid(("local", "vllm"), 40, 10, 256),
    "quick": Grid(("local", "vllm"), 12, 6, 128),
    "tiny": Grid(("local",), 3, 3, 16),
}


def train(engine: str, mode: str, grid: Grid, scratch: Path) -> dict[str, Any]:
    """One ``corun train`` of the job; its figures."""
    out = scratch / f"{engine}-{mode.replace(', ', '-').replace(' ', '-')}"
    command = [
        sys.executable, "-m", "corun", "train", "hf_grpo", f"trainer.kind={JOB}",
        f"trainer.engine={engine}", f"run.dir={out}", f"run.steps={grid.steps}",
        f"loop.eval_interval={grid.eval_every}", f"trainer.eval_size={grid.eval_size}",
        f"loop.save_interval={grid.steps}", "loop.lr_schedule=constant", "log.progress=off",
        *MODES[mode],
    ]  # fmt: skip
    done = subprocess.run(command, cwd=scratch, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine}, {mode} exited {done.returncode}:\n{done.stderr[-3000:]}")
    _, curve = training_curve(out)
    metrics = read_records(out / "metrics.jsonl")

    def mean(key: str) -> float | None:
        values = [m[key] for m in metrics if key in m]
        return statistics.fmean(values) if values else None

    train_s = float(curve[-1][1])  # to the last step, evaluated (steps: eval_every's multiple)
    generated = max(m.get("longtail/generated_tokens_total", 0.0) for m in metrics)
    return {
        "train_s": train_s, "steps_per_s": grid.steps / train_s,
        "tokens_per_s": generated / train_s, "sync_s": mean("perf/sync_time_s"),
        "idle": mean("perf/generator_idle_ratio"), "staleness": mean("async/staleness_mean"),
        "curve": curve,
    }  # fmt: skip


def reward_at(curve: list[Any], seconds: float) -> float:
    """The last held-out reward evaluated within ``seconds`` of training."""
    return float([value for _, t, value in curve if t <= seconds + 1e-9][-1])


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    grid = GRIDS[grid_name]
    engines = [e for e in grid.engines if e != "vllm" or find_spec("vllm") is not None]
    tables = []
    for engine in engines:
        runs = {}
        for mode in MODES:
            note(f"{engine}: {mode}, {grid.steps} steps")
            runs[mode] = train(engine, mode, grid, scratch)
        tables.append(table(engine, grid, runs))
    return tables


def table(engine: str, grid: Grid, runs: dict[str, dict[str, Any]]) -> Table:
    shortest = min(run["train_s"] for run in runs.values())
    sync = runs["sync"]
    rows, ratios = [], []
    for mode, run in runs.items():
        rows.append([
            mode, fmt(run["tokens_per_s"], 0), fmt(run["steps_per_s"], 3),
            "-" if run["sync_s"] is None else fmt(run["sync_s"], 3),
            "-" if run["idle"] is None else fmt(run["idle"], 2),
            "-" if run["staleness"] is None else fmt(run["staleness"], 2),
            f"{reward_at(run['curve'], shortest):.3f}",
            f"{run['tokens_per_s'] / sync['tokens_per_s']:.2f}",
        ])  # fmt: skip
        ratios.append((mode, run["tokens_per_s"] / sync["tokens_per_s"]))
    return Table(
        "longtail", engine, f"Long-tailed generation on the {engine} engine: sync, async "
        f"with drain, async with in-flight updates ({grid.steps} steps each)",
        ["mode", "generated tokens/s", "steps/s", "sync s (mean)", "generator idle share",
         "staleness (mean)", f"held-out reward at {shortest:.0f} s", "tokens/s vs sync"],
        rows, ratios, "the synchronous run's generated tokens/s, same bench run",
        ["Generation lengths: the recipe's 8 new tokens times a Pareto(1.2) draw capped at "
         "25 (benchmarks/longtail_job.py), the end-of-sequence id ignored, each row then cut "
         "back to the recipe's reply for the reward and the update. Rates over training "
         "time (evaluations excluded); the held-out reward: each run's last evaluation "
         "within the shortest run's training time."],
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main_of("longtail", __doc__.splitlines()[0]))
