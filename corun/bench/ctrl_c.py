"""Ctrl-C to exit: real ``corun train sft`` processes, SIGINT (at its default
disposition) after a few steps, with and without the save on interrupt; the ``ctrl_c``
suite of ``corun bench``."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from corun.bench.report import Note, Table, fmt

GRIDS = {"full": (5, 40), "quick": (1, 5), "tiny": (1, 3)}  # repeats, steps before SIGINT


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # whatever this process's disposition


def ctrl_c_latency(run_dir: Path, save: bool, after_steps: int) -> float:
    """A ``corun train sft`` process, SIGINT once it has made ``after_steps`` steps;
    seconds from the signal to its exit."""
    command = [sys.executable, "-m", "corun.host.cli", "train", "sft", f"run.dir={run_dir}",
               "run.steps=100000", "log.progress=off", "loop.eval_interval=0",
               "loop.save_interval=0", f"loop.save_on_interrupt={str(save).lower()}"]  # fmt: skip
    child = subprocess.Popen(
        command, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, preexec_fn=_default_sigint, start_new_session=True,
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


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench ctrl_c``: SIGINT to exit, the median without a save the baseline."""
    repeats, after = GRIDS[grid]
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
        "ctrl_c", "latency", "Ctrl-C (SIGINT) to exit of corun train sft",
        ["case", "runs", "median ms", "max ms", "median vs without save"], rows,
        [(f"{'with' if save else 'without'} save", statistics.median(s) / base)
         for save, s in samples.items()],
        "the median without a save, same run",
    )]  # fmt: skip
