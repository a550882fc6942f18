"""The template's share of a real GRPO step with vLLM generating: ``hf_grpo`` on the
built-in tiny Llama, ``engine = "vllm"``, concurrency 1, no eval, a ``corun train`` in a
child process on a config built here. Each step interval (``t`` of the ``step``
events) against the hooks in it (``metrics.jsonl``: the last step's sync, this step's
rollout and train); the rest is the template's share. The rollout splits into
generate, reward and the trainer's own code (prompts, batch). Part of
``python -m benchmarks.engines`` (benchmarks/engines.py).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import anyio

from benchmarks.report import Note
from corun.base.config import to_toml
from corun.contract.config_file import config_from_dict
from corun.execution.procs import ChildProcess
from corun.records.events import EVENTS_FILE, METRICS_FILE, read_records

ENGINE = "vllm"
PROMPTS, SAMPLES = 16, 8  # 128 sequences a step, max_new_tokens (8) each
TRAINER = {"kind": "hf_grpo", "model": "tiny-llama", "engine": ENGINE,
           "samples_per_prompt": SAMPLES, "lr": 1e-3}  # fmt: skip


@dataclass
class Result:
    steps: int
    intervals: int  # step intervals the figures are taken over
    mean_ms: dict[str, float]  # step, then its parts; the parts sum to the step
    outside_share_median: float  # per-step (step - hooks) / step, median
    setup_s: float  # run start to the end of setup (model, vLLM start, weight sync)


def start(scratch: Path, steps: int) -> ChildProcess:
    """``corun train`` in its own process group, on a config built here; a log beside."""
    config = config_from_dict({
        "run": {"name": "engines-grpo", "dir": str(scratch / "run"), "steps": steps},
        "loop": {"concurrency": 1, "baseline_eval": False, "eval_interval": 0},
        "log": {"progress": "off", "wandb": "disabled"},
        "data": {"batch_size": PROMPTS}, "trainer": TRAINER,
    })  # fmt: skip
    (scratch / "grpo.toml").write_text(to_toml(config))
    with open(scratch / "grpo.log", "wb") as log:
        argv = [sys.executable, "-m", "corun", "train", str(scratch / "grpo.toml")]
        return ChildProcess(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def breakdown(scratch: Path, code: int, skip: int) -> Result:
    """Each step interval against the hooks that ran in it (at concurrency 1 they run
    one after another: the previous step's sync, then this step's rollout and train)."""
    if code != 0:
        log = (scratch / "grpo.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"corun train (GRPO) exited with status {code}:\n{log}")
    run_dir = scratch / "run"
    events = read_records(run_dir / EVENTS_FILE)
    step_t = {e["step"]: e["t"] for e in events if e["event"] == "step"}
    setup_s = next(e["t"] for e in events if e["event"] == "setup") - events[0]["t"]
    metrics: dict[int, dict[str, float]] = {}
    for record in read_records(run_dir / METRICS_FILE):
        metrics.setdefault(record["step"], {}).update(record)
    parts: dict[str, list[float]] = {}
    shares = []
    for prev, step in list(pairwise(sorted(step_t)))[skip:]:
        m, wall = metrics[step], step_t[step] - step_t[prev]
        hooks = {
            "generate": m["perf/generate_time_s"],
            "reward": m["perf/reward_time_s"],
            "rollout, other": m["perf/rollout_time_s"] - m["perf/generate_time_s"]
            - m["perf/reward_time_s"],
            "train": m["perf/train_time_s"],
            "sync": metrics[prev]["perf/sync_time_s"],
        }  # fmt: skip
        outside = wall - sum(hooks.values())
        shares.append(outside / wall)
        for name, seconds in {"step": wall, **hooks, "outside the hooks": outside}.items():
            parts.setdefault(name, []).append(seconds)
    means = {name: round(statistics.fmean(s) * 1e3, 3) for name, s in parts.items()}
    return Result(len(step_t), len(shares), means, round(statistics.median(shares), 4),
                  round(setup_s, 2))  # fmt: skip


async def measure(steps: int, skip: int, progress: Note) -> Result:
    """On any way out the run gets SIGTERM (it tears its engine down), SIGKILL after 30 s."""
    progress(f"GRPO with engine {ENGINE!r}: {steps} steps")
    with tempfile.TemporaryDirectory(prefix="corun-engines-") as scratch:
        child = start(Path(scratch), steps)
        try:
            while (code := child.popen.poll()) is None:  # noqa: ASYNC110 (another process)
                await anyio.sleep(0.1)
        finally:
            with anyio.CancelScope(shield=True):  # at once if it has exited
                await anyio.to_thread.run_sync(child.stop, 30.0)
        result = breakdown(Path(scratch), code, skip)
    progress(f"GRPO: step {result.mean_ms['step']:.1f} ms, outside the hooks "
             f"{result.outside_share_median:.1%}")  # fmt: skip
    return result


def print_result(result: Result) -> None:
    print(f"GRPO step, engine {ENGINE!r} (hf_grpo, {PROMPTS} prompts x {SAMPLES} samples, "
          f"concurrency 1): mean over {result.intervals} step intervals (of {result.steps} "
          f"steps; setup {result.setup_s:.1f} s)")  # fmt: skip
    step = result.mean_ms["step"]
    for name, ms in result.mean_ms.items():
        print(f"  {name:<18} {ms:9.2f} ms {ms / step:7.1%}")
    print(f"  the template's share of a step (outside the hooks), per-step median: "
          f"{result.outside_share_median:.2%}")  # fmt: skip
