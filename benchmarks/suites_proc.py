"""``corun bench``'s suites that run ``corun train`` (or a measurement) in fresh
processes: time to reward, Ctrl-C latency, and a run sharing the machine."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import agentic, overhead, real_grpo
from benchmarks.bench_report import Table, fmt
from benchmarks.suites import Note

TIME_TO_REWARD = {  # GRPO (steps, eval interval), agentic (steps, eval interval, latencies)
    "full": ((300, 25), (60, 5, (0.0, 25.0, 100.0))),
    "quick": ((16, 8), (6, 3, (100.0,))),
    "tiny": ((4, 2), (4, 2, (100.0,))),
}


def _reached(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Seconds (from the end of the baseline eval) to the first eval after it at
    ``target`` or above."""
    return next((t for step, t, value in curve if step > 0 and value >= target), None)


def suite_time_to_reward(grid: str, scratch: Path, note: Note) -> list[Table]:
    """Sync vs async wall time to the same held-out reward: configs/grpo.toml vs
    grpo_async.toml, and configs/agentic.toml vs agentic_async.toml over tool latencies."""
    (steps, every), (a_steps, a_every, latencies) = TIME_TO_REWARD[grid]
    rows, ratios = [], []

    def add(task: str, sync: dict, async_: dict, target: float, steps: int) -> None:  # type: ignore[type-arg]
        sync_at, async_at = _reached(sync["curve"], target), _reached(async_["curve"], target)
        ratio = async_at / sync_at if sync_at and async_at else None
        # Training time over the steps: a median interval misses async's bursts of steps.
        sync_step, async_step = sync["train_s"] / steps, async_["train_s"] / steps
        per_step = async_step / sync_step
        rows.append([task, f"{target:.3f}", fmt(sync_step, 3), fmt(async_step, 3),
                     f"{per_step:.2f}", "never" if sync_at is None else fmt(sync_at, 1),
                     "never" if async_at is None else fmt(async_at, 1),
                     "-" if ratio is None else f"{ratio:.2f}"])  # fmt: skip
        ratios.append((f"{task}: time per step", per_step))
        if ratio is not None:
            ratios.append((f"{task}: time to target", ratio))

    runs = {}
    for config in real_grpo.CONFIGS:
        note(f"{config}: {steps} steps")
        runs[config] = real_grpo.train(config, scratch / Path(config).stem, steps, every)
    sync, async_ = (runs[c] for c in real_grpo.CONFIGS)
    # The lower of the two runs' best eval after the baseline (where both start).
    target = min(max(r for step, _, r in res["curve"] if step > 0 or len(res["curve"]) == 1)
                 for res in (sync, async_))  # fmt: skip
    add("GRPO (sort)", sync, async_, target, steps)
    for latency in latencies:
        note(f"agentic, tool latency {latency:g} ms: {a_steps} steps")
        row = agentic.compare(latency, a_steps, a_every, scratch)
        add(f"agentic, tools {latency:g} ms", row["sync"], row["async"], row["target"], a_steps)
    return [Table(
        "time_to_reward", "ratio", "Sync vs async: wall time to the same held-out reward",
        ["task", "target", "sync s/step", "async s/step", "async / sync per step",
         "sync s to target", "async s to target", "async / sync to target"], rows, ratios,
        "the sync run's time (per step, to the target), same run; below 1: async is faster",
        ["GRPO's target: the lower of the two runs' best eval reward after the baseline; "
         "agentic's: the sync run's final eval success. Times from the end of the baseline "
         "eval to the first later eval at the target; s/step: training time (from there) "
         "over the steps (\"never\": not within the run)."],
    )]  # fmt: skip


CTRL_C = {"full": (5, 40), "quick": (1, 5), "tiny": (1, 3)}  # repeats, steps before SIGINT


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # whatever this process's disposition


def ctrl_c_latency(run_dir: Path, save: bool, after_steps: int) -> float:
    """A ``corun train configs/sft.toml`` process, SIGINT once it has made
    ``after_steps`` steps; seconds from the signal to its exit."""
    command = [sys.executable, "-m", "corun.host.cli", "train", "configs/sft.toml",
               f"run.dir={run_dir}", "run.steps=100000", "log.progress=off",
               "loop.eval_interval=0", "loop.save_interval=0",
               f"loop.save_on_interrupt={str(save).lower()}"]  # fmt: skip
    child = subprocess.Popen(
        command, cwd=overhead.ROOT, env={**os.environ, "WANDB_MODE": "disabled"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_default_sigint,
        start_new_session=True,
    )  # fmt: skip
    events = run_dir / "events.jsonl"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            text = events.read_text() if events.exists() else ""
            if text.count('"event":"step"') + text.count('"event": "step"') >= after_steps:
                break
            time.sleep(0.05)
        sent = time.perf_counter()
        child.send_signal(signal.SIGINT)
        code = child.wait(timeout=120)
        latency = time.perf_counter() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if code != 130:
        raise RuntimeError(f"corun train after SIGINT: exit status {code}, not 130")
    return latency


def suite_ctrl_c(grid: str, scratch: Path, note: Note) -> list[Table]:
    """Ctrl-C to exit: real ``corun train`` processes (SIGINT at its default disposition),
    with and without the save on interrupt."""
    repeats, after = CTRL_C[grid]
    samples: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(repeats):
        for save in (False, True) if repeat % 2 == 0 else (True, False):
            note(f"SIGINT after {after} steps, {'with' if save else 'no'} save ({repeat + 1})")
            run_dir = scratch / f"ctrl-c-{save}-{repeat}"
            samples[save].append(ctrl_c_latency(run_dir, save, after))
    base = statistics.median(samples[False])
    rows = [[("with" if save else "without") + " save", str(len(s)),
             fmt(statistics.median(s) * 1e3, 0), fmt(max(s) * 1e3, 0),
             f"{statistics.median(s) / base:.2f}"] for save, s in samples.items()]  # fmt: skip
    return [Table(
        "ctrl_c", "latency", "Ctrl-C (SIGINT) to exit of corun train configs/sft.toml",
        ["case", "runs", "median ms", "max ms", "median vs without save"], rows,
        [(f"{'with' if save else 'without'} save", statistics.median(s) / base)
         for save, s in samples.items()],
        "the median without a save, same run",
    )]  # fmt: skip


SHARED = {"full": 80, "quick": 20, "tiny": 5}  # steps
COMPETITORS = {  # what runs beside the measurement: a command, killed after
    "quiet": None,
    "one busy process": "while True: pass",
    "a plain torch loop": "import torch\nx = torch.randn(256, 256)\nwhile True: x @ x",
}


def suite_shared(grid: str, scratch: Path, note: Note) -> list[Table]:
    """The same short SFT run (configs/sft.toml's model, in a fresh process) on the quiet
    machine, with one busy process beside it, and with a plain torch loop beside it:
    corun's default (torch threads from the free cores) against 2 fixed threads (torch's
    own default, corun's before), inline compute and a plain torch SFT loop as the
    measured run (not in the quick grid)."""
    steps = SHARED[grid]
    subjects = [("corun run, default (free cores)", "run", "thread", 0)]
    if grid != "quick":  # a tiny grid tries every row
        subjects += [("corun run, 2 fixed threads (before)", "run", "thread", 2),
                     ("corun run, inline compute", "run", "inline", 0),
                     ("plain torch SFT loop", "plain", "inline", 0)]  # fmt: skip
    rows, ratios = [], []
    for label, what, compute, threads in subjects:
        times: dict[str, float] = {}
        for beside, code in COMPETITORS.items():
            note(f"{label}, {beside}")
            run_dir = scratch / f"shared-{what}-{compute}-{threads}-{len(times)}"
            request = {"what": what, "steps": steps, "backend": "asyncio", "compute": compute,
                       "run_dir": str(run_dir), "lane_threads": threads}  # fmt: skip
            hog = None if code is None else subprocess.Popen([sys.executable, "-c", code])
            try:
                times[beside] = statistics.median(overhead.in_fresh_process(request))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        quiet = times["quiet"]
        rows.append([label, *(fmt(t * 1e3) for t in times.values()),
                     *(f"{times[b] / quiet:.2f}" for b in list(COMPETITORS)[1:])])  # fmt: skip
        ratios += [(f"{label}: {b}", times[b] / quiet) for b in list(COMPETITORS)[1:]]
    return [Table(
        "shared", "slowdown", f"A short SFT run ({steps} steps) sharing the machine",
        ["run", *(f"{b}: ms/step" for b in COMPETITORS),
         *(f"slowdown, {b}" for b in list(COMPETITORS)[1:])], rows, ratios,
        "the same run on the quiet machine, same bench run",
        ["Beside it: `python -c 'while True: pass'`, or a loop of 256x256 matmuls at torch's "
         "default threads; killed after each measurement. Median step interval. The default "
         "re-reads the free cores four times a second (corun/execution/cores.py); the fixed row is "
         "`loop.lane_threads = 2`."],
    )]  # fmt: skip
