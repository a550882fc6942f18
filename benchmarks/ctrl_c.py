"""Ctrl-C to exit: real ``corun train`` processes, SIGINT (at its default disposition)
after a few trained steps; the ``ctrl_c`` suite of ``corun bench``.

Two tables: ``corun train sft`` with and without the save on interrupt (every grid),
and on the full grid every shipped recipe that trains, plus the in-process vLLM
recipe on a vLLM server and the async recipe on Ray workers. The recipes run in one
folder, so a prerequisite (hf_grpo_vllm's hf_sft, ...) trains once, before its first
measurement, and is reused after.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import Note, Table, fmt
from corun.recipes import names

GRIDS = {"full": (5, 40), "quick": (1, 5), "tiny": (1, 3)}  # repeats, steps before SIGINT
RECIPE_REPEATS, RECIPE_STEPS = 2, 2  # the full grid's every-recipe table
SERVE_ONLY = ("tinker",)  # recipes `corun serve` runs: nothing trains
VARIANTS = {  # name: (recipe, overrides)
    "hf_grpo_vllm, vllm-server": ("hf_grpo_vllm", ("trainer.engine=vllm-server",)),
    "grpo_async, ray": ("grpo_async", ("rollout.backend=ray",)),
}
WAIT_S = 900.0  # for the steps before the signal: a first run trains its prerequisite


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # whatever this process's disposition


def ctrl_c_latency(
    recipe: str, run_dir: Path, after_steps: int, overrides: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> float:  # fmt: skip
    """A ``corun train RECIPE`` process, SIGINT once it has made ``after_steps`` steps;
    seconds from the signal to its exit (130, or RuntimeError)."""
    command = [sys.executable, "-m", "corun", "train", recipe, f"run.dir={run_dir}",
               "run.steps=100000", "log.progress=off", "loop.eval_interval=0",
               "loop.save_interval=0", *overrides]  # fmt: skip
    child = subprocess.Popen(
        command, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, preexec_fn=_default_sigint, start_new_session=True, cwd=cwd,
    )  # fmt: skip
    events = run_dir / "events.jsonl"
    try:
        deadline = time.monotonic() + WAIT_S
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
        raise RuntimeError(f"corun train {recipe} after SIGINT: exit status {code}, not 130")
    return latency


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench ctrl_c``: SIGINT to exit, the median without a save the baseline."""
    tables = [_save_or_not(grid, scratch, note)]
    if grid == "full":
        tables.append(_every_recipe(scratch, note))
    return tables


def _save_or_not(grid: str, scratch: Path, note: Note) -> Table:
    repeats, after = GRIDS[grid]
    samples: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(repeats):
        for save in (False, True) if repeat % 2 == 0 else (True, False):
            note(f"SIGINT after {after} steps, {'with' if save else 'no'} save ({repeat + 1})")
            run_dir = scratch / f"ctrl-c-{save}-{repeat}"
            setting = f"loop.save_on_interrupt={str(save).lower()}"
            samples[save].append(ctrl_c_latency("sft", run_dir, after, (setting,)))
    base = statistics.median(samples[False])
    rows = [[("with" if save else "without") + " save", str(len(s)),
             fmt(statistics.median(s) * 1e3, 0), fmt(max(s) * 1e3, 0),
             f"{statistics.median(s) / base:.2f}"] for save, s in samples.items()]  # fmt: skip
    return Table(
        "ctrl_c", "latency", "Ctrl-C (SIGINT) to exit of corun train sft",
        ["case", "runs", "median ms", "max ms", "median vs without save"], rows,
        [(f"{'with' if save else 'without'} save", statistics.median(s) / base)
         for save, s in samples.items()],
        "the median without a save, same run",
    )  # fmt: skip


def _every_recipe(scratch: Path, note: Note) -> Table:
    """Each recipe that trains (and the variants), SIGINT after RECIPE_STEPS steps."""
    cases = {name: (name, ()) for name in names() if name not in SERVE_ONLY} | VARIANTS
    folder = scratch / "recipes"  # where prerequisites are trained once and reused
    folder.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[float]] = {}
    for label, (recipe, overrides) in cases.items():
        for repeat in range(RECIPE_REPEATS):
            note(f"SIGINT in {label} after {RECIPE_STEPS} steps ({repeat + 1})")
            run_dir = folder / f"ctrl-c-{label.replace(', ', '-')}-{repeat}"
            samples.setdefault(label, []).append(
                ctrl_c_latency(recipe, run_dir.resolve(), RECIPE_STEPS, overrides, folder)
            )
    every = [s for runs in samples.values() for s in runs]
    median_all, bound = statistics.median(every), 0.5
    rows = [[label, str(len(s)), fmt(statistics.median(s) * 1e3, 0), fmt(max(s) * 1e3, 0),
             f"{statistics.median(s) / bound:.2f}"] for label, s in samples.items()]  # fmt: skip
    rows.append(["every run", str(len(every)), fmt(median_all * 1e3, 0),
                 fmt(max(every) * 1e3, 0), f"{median_all / bound:.2f}"])  # fmt: skip
    return Table(
        "ctrl_c", "recipes", "Ctrl-C (SIGINT) to exit, save on interrupt, every shipped recipe",
        ["recipe", "runs", "median ms", "max ms", "median vs 0.5 s"], rows,
        [(row[0], float(row[-1])) for row in rows],
        "the 0.5 s bound on the median (worst: 1.5 s)",
    )  # fmt: skip
