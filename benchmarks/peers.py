"""``corun bench peers``: corun against another runtime on the same job. GRPO on the
built-in word problems with the tiny Llama, warm-started from the shipped ``hf_sft``
recipe (trained first, then exported: both runtimes load the same directory), 16
prompts x 8 samples per step in the same order, the numeric-match reward, 8 new tokens,
lr 3e-4 constant, clip 0.2, no KL, token-mean loss (TRL's "dapo"), float32, the same
torch threads. Each run is a fresh process; the runtimes alternate within each repeat.

Rows: corun ``hf_grpo`` on its transformers engine, as shipped (``OMP_WAIT_POLICY=
PASSIVE``, set by corun) and spinning (``ACTIVE``); TRL's ``GRPOTrainer`` as installed
(torch's OpenMP threads spin between parallel regions: faster at small ops on a quiet
machine, stalled beside another busy process) and with ``OMP_WAIT_POLICY=PASSIVE``.
Figures: s/step and generation s/step (medians over the steps, then over the repeats),
the rest of the step, generated tokens/s, peak RSS of the process, the held-out reward
of each final model by one evaluation (:func:`held_out_rewards`, on the exported
models), and training time to TRL's (passive) final reward (evaluations excluded).

::

    python -m benchmarks.peers           # 60 steps (6 at ~50M), 3 repeats: ~25 minutes
    python -m benchmarks.peers --quick   # 6 steps (2 at ~6M), 1 repeat

TRL comes from the ``peers`` extra (``pip install -c constraints-cpu.txt -e
'.[peers]'``); without it the suite says so in one line. Nothing is asserted; measure
on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.report import Note, Table, fmt, markdown_grid, markdown_table
from corun.records.events import EVENTS_FILE, read_records

ENV = {**os.environ, "WANDB_MODE": "disabled"}
THREADS = 2  # torch intra-op threads of every run (this machine's cores)
EVAL_SIZE = 256  # held-out prompts, greedy


@dataclass(frozen=True)
class Job:
    """The job, as both runtimes are told it."""

    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 8
    lr: float = 3e-4
    clip: float = 0.2
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


JOB = Job()
# (setting, corun, TRL, matched?): what is the same, and what cannot be.
MATCHED = [
    ("model and start", "the exported hf_sft warm start", "the same directory", "yes"),
    ("prompts per step, order", "WordProblems(16, seed 0).batch(i) at step i+1",
     "the same batches, in order (shuffle_dataset = false)", "yes"),
    ("samples per prompt / new tokens", "8 / 8", "num_generations 8 / max_completion_length 8",
     "yes"),
    ("prompt ids", "the chat template, no special tokens added", "the same (conversational)",
     "yes"),
    ("reward", "numeric_match", "numeric_match (wrapped)", "yes"),
    ("loss", "clipped ratio 0.2, token-mean over the batch, no KL", "loss_type dapo, "
     "epsilon 0.2, beta 0", "yes"),
    ("advantages", "(r - mean) / (std + 1e-6) per group", "(r - mean) / (std + 1e-4) per "
     "group", "no: TRL's epsilon"),
    ("optimizer", "AdamW, lr 3e-4 constant, no decay, grad clip 1.0", "adamw_torch, the "
     "same", "yes"),
    ("updates per step", "1 (128 completions)", "1 (per_device_train_batch_size 128)", "yes"),
    ("sampling", "temperature 1, top-p 1, inverse-CDF draws", "temperature 1, top-p 1, "
     "torch.multinomial", "no: other random streams"),
    ("precision, threads", f"float32, {THREADS}", f"float32, {THREADS}", "yes"),
]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A randomly initialised Llama with the tiny model's tokenizer (heads of 32)."""

    hidden: int
    layers: int
    heads: int


# The ~50M-parameter Llama: where compute, not overhead, dominates a step.
BIG = Shape(hidden=768, layers=10, heads=12)
# --quick's bigger model: the same code path at an eighth of the compute (~6M).
SMALLER = Shape(hidden=384, layers=4, heads=12)


@dataclass(frozen=True)
class Grid:
    steps: int  # the tiny model's runs
    repeats: int
    eval_every: int
    big_steps: int  # the bigger model's (speed alone); 0: not run, else ≥ 2 (a step timed)
    big: Shape = BIG


GRIDS = {
    "full": Grid(60, 3, 15, 6),
    "quick": Grid(6, 1, 3, 2, SMALLER),
    "tiny": Grid(3, 1, 3, 0),
}


def trl_missing() -> str | None:
    """One line when TRL is not installed, else None."""
    if find_spec("trl") is None:
        return "TRL is not installed: pip install -c constraints-cpu.txt -e '.[peers]'"
    return None


# ----------------------------------------------------------------------------- the job


def job(*args: str) -> Any:
    """``python -m benchmarks.peers_job ARGS``'s answer: trainers/ is reached through
    processes only (docs/architecture.md). A failure raises with the end of its stderr."""
    command = [sys.executable, "-m", "benchmarks.peers_job", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"peers_job {args[0]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_start(scratch: Path) -> Path:
    """The shipped hf_sft recipe's final model, exported once under ``scratch``."""
    return Path(job("warm-start", str(scratch)))


def big_model(scratch: Path, shape: Shape = BIG) -> tuple[Path, float]:
    """A model of ``shape`` (randomly initialised), built once under ``scratch``, and its
    parameter count to one significant figure, in millions."""
    path, params = job("big-model", str(scratch), str(shape.hidden), str(shape.layers),
                       str(shape.heads))  # fmt: skip
    return Path(path), float(f"{params / 1e6:.1g}")


def held_out_rewards(models: Sequence[Path]) -> list[tuple[float, float]]:
    """Each model's mean numeric-match reward (and its standard error) on greedy replies
    to the first :data:`EVAL_SIZE` held-out word problems, in one process: the one
    evaluation every runtime's model is scored by."""
    return [(mean, se) for mean, se in job("score", *map(str, models))]


def measured(command: list[str], env: dict[str, str]) -> float:
    """Run ``command``; the peak RSS of its process, in MiB (``wait4``'s, that process
    alone). A failure raises with the end of its stderr."""
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{command[2:5]} exited {proc.returncode}:\n{stderr[-3000:]}")
    return usage.ru_maxrss / 1024


def run_corun(
    model: Path, steps: int, eval_every: int, out: Path, spinning: bool = False,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """``corun train hf_grpo`` on the job; its figures (as :func:`run_trl`'s). With
    ``eval_every`` 0: speed alone (no evaluation, no final model); ``spinning``: with
    ``OMP_WAIT_POLICY=ACTIVE`` (corun's default is passive); ``overrides``: settings
    beside the job's (``loop.micro_batch_tokens=1024``)."""
    evals = [f"loop.eval_interval={eval_every}", f"trainer.eval_size={EVAL_SIZE}"]
    command = [
        sys.executable, "-m", "corun", "train", "hf_grpo", f"run.dir={out}",
        f"trainer.model=hf:{model}", 'trainer.init_from=""', f"run.steps={steps}",
        "loop.lr_schedule=constant", f"loop.lane_threads={THREADS}",
        f"loop.save_interval={steps}", "log.progress=off",
        *(evals if eval_every else ["loop.eval_interval=0", "loop.baseline_eval=false"]),
        *overrides,
    ]  # fmt: skip
    rss = measured(command, {**ENV, "OMP_WAIT_POLICY": "ACTIVE" if spinning else "PASSIVE"})
    step_times, curve = training_curve(out)
    metrics = read_records(out / "metrics.jsonl")
    generate = [m["perf/generate_time_s"] for m in metrics if "perf/generate_time_s" in m]
    tokens = [m["rollout/response_len_mean"] for m in metrics if "rollout/response_len_mean" in m]
    figures = measures(step_times, generate, tokens, rss, curve)
    if eval_every:
        figures["final"] = Path(job("export", str(out), str(out / "final-model")))
    return figures


def training_curve(out: Path) -> tuple[list[float], list[tuple[int, float, float]]]:
    """A corun run's step times and its held-out reward by (step, training seconds): the
    seconds since set-up, evaluations excluded."""
    events = read_records(out / EVENTS_FILE)
    metrics = read_records(out / "metrics.jsonl")
    start = next(e["t"] for e in events if e["event"] in ("baseline_eval", "setup"))
    eval_s = {m["step"]: m["perf/eval_time_s"] for m in metrics if "perf/eval_time_s" in m}
    stepped = [e for e in events if e["event"] == "step"]
    step_times = [b["t"] - a["t"] - eval_s.get(a["step"], 0.0) for a, b in pairwise(stepped)]
    train_s = {
        e["step"]: e["t"] - start - sum(s for k, s in eval_s.items() if 0 < k < e["step"])
        for e in stepped
    }
    curve = [(m["step"], train_s.get(m["step"], 0.0), m["eval/reward"])
             for m in metrics if "eval/reward" in m]  # fmt: skip
    return step_times, curve


def run_trl(model: Path, steps: int, eval_every: int, out: Path, passive: bool) -> dict[str, Any]:
    """TRL's GRPOTrainer on the job in a fresh ``python -m benchmarks.peers_job trl``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    command = [sys.executable, "-m", "benchmarks.peers_job", "trl", str(model), str(out),
               "--steps", str(steps), "--eval-every", str(eval_every)]  # fmt: skip
    rss = measured(command, env)
    got = json.loads((out / "figures.json").read_text())
    figures = measures(got["step_s"], got["generate_s"], got["tokens"], rss,
                       [tuple(p) for p in got["curve"]])  # fmt: skip
    if eval_every:
        figures["final"] = out / "final-model"
    return figures


def measures(
    step_s: list[float], generate_s: list[float], tokens: list[float], rss_mib: float,
    curve: list[Any],
) -> dict[str, Any]:  # fmt: skip
    """One run's figures; the first step (warm-up: allocations, first calls) left out."""
    step = statistics.median(step_s[1:] or step_s)
    gen = statistics.median(generate_s[1:] or generate_s)
    return {
        "step_s": step, "generate_s": gen, "rest_s": step - gen,
        "tokens_per_s": statistics.fmean(tokens) * JOB.batch / gen, "rss_mib": rss_mib,
        "curve": curve,
    }  # fmt: skip


# ----------------------------------------------------------------------------- corun bench

# corun waits passively by default (corun/__init__.py); TRL spins as installed. Each
# runtime both ways: on a quiet machine spinning is faster at small ops, beside another
# busy process it stalls.
RUNTIMES = (
    "corun hf_grpo", "corun, OMP_WAIT_POLICY=ACTIVE", "TRL as installed",
    "TRL, OMP_WAIT_POLICY=PASSIVE",
)  # fmt: skip


def compare(
    model: Path, steps: int, eval_every: int, repeats: int, scratch: Path, note: Note,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Every runtime ``repeats`` times on ``model``, interleaved; with ``eval_every``,
    each final model scored (and the start)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNTIMES}
    for repeat in range(repeats):
        for name in RUNTIMES:
            note(f"{name}: {model.name}, {steps} steps (repeat {repeat + 1} of {repeats})")
            out = scratch / f"{model.name}-{name.split(',')[0].replace(' ', '-')}-{repeat}"
            if name.startswith("corun"):
                got = run_corun(model, steps, eval_every, out, spinning="ACTIVE" in name)
            else:
                got = run_trl(model, steps, eval_every, out, passive="PASSIVE" in name)
            results[name].append(got)
    if eval_every:
        note(f"scoring the {len(RUNTIMES) * repeats} final models and the start")
        runs = [got for name in RUNTIMES for got in results[name]]
        *finals, (start, _) = held_out_rewards([got["final"] for got in runs] + [model])
        for got, (reward, reward_se) in zip(runs, finals, strict=True):
            got.update(reward=reward, reward_se=reward_se)
        results["start"] = [{"reward": start}]
    return results


def time_to(curve: list[Any], target: float) -> float | None:
    """Training seconds to the first evaluation after the start at ``target`` or above."""
    return next((float(t) for step, t, value in curve if step > 0 and value >= target), None)


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench peers``: corun against TRL on one GRPO job."""
    missing = trl_missing()
    if missing:
        note(missing)
        return [Table("peers", "trl", "Against TRL: not run", ["runtime"], [], [], "",
                      [missing])]  # fmt: skip
    return run_grid(GRIDS[grid_name], scratch, note)


def run_grid(grid: Grid, scratch: Path, note: Note) -> list[Table]:
    tiny = compare(warm_start(scratch), grid.steps, grid.eval_every, grid.repeats, scratch, note)
    found = [learning_table(grid, tiny)]
    if grid.big_steps:
        model, millions = big_model(scratch, grid.big)
        big = compare(model, grid.big_steps, 0, grid.repeats, scratch, note)
        found.append(speed_table(grid, big, millions))
    return found


Results = dict[str, list[dict[str, Any]]]
FAIR = RUNTIMES[3]  # TRL with passive waiting (as corun's default): every ratio's baseline


def _median(results: Results, name: str, key: str) -> float:
    return float(statistics.median(r[key] for r in results[name]))


def _speed_cells(results: Results, name: str) -> list[str]:
    keys = (("step_s", 3), ("generate_s", 3), ("rest_s", 3), ("tokens_per_s", 0), ("rss_mib", 0))
    return [name, *(fmt(_median(results, name, key), digits) for key, digits in keys)]


def _ratios(results: Results) -> list[tuple[str, float]]:
    fair = _median(results, FAIR, "step_s")
    return [(name, fair / _median(results, name, "step_s")) for name in RUNTIMES]


SPEED = ["runtime", "s/step", "generation s/step", "rest s/step", "tokens/s", "peak RSS MiB"]
BASELINE = "TRL with passive waiting's steps per second; above 1: faster"
MEDIANS = "Medians over the steps (the first left out), then over the repeats."


def learning_table(grid: Grid, results: Results) -> Table:
    """The tiny model from the warm start: speed, memory, and what was learnt."""
    target = _median(results, FAIR, "reward")  # TRL's final reward (the fair set-up)
    rows = []
    for name in RUNTIMES:
        reached = [time_to(r["curve"], target) for r in results[name]]
        to_target = statistics.median(t for t in reached if t is not None) if all(reached) else None
        rows.append([
            *_speed_cells(results, name), f"{_median(results, name, 'reward'):.3f} ± "
            f"{_median(results, name, 'reward_se'):.3f}",
            "never" if to_target is None else fmt(to_target, 1),
        ])  # fmt: skip
    start = results["start"][0]["reward"]
    return Table(
        "peers", "trl", f"Against TRL on one GRPO job: the tiny Llama ({grid.steps} steps, "
        f"{grid.repeats} interleaved repeats)",
        [*SPEED, f"held-out reward ({start:.3f} before)", f"train s to {target:.3f}"],
        rows, _ratios(results), BASELINE,
        [f"{MEDIANS} Held-out reward: {EVAL_SIZE} greedy replies, one evaluation of every "
         "final model. The target: TRL's (passive) final reward; training time excludes "
         "evaluations.",
         "\nMatched settings:\n\n"
         + "\n".join(markdown_grid(["setting", "corun", "TRL", "matched"], MATCHED))],
    )  # fmt: skip


def speed_table(grid: Grid, results: Results, millions: float) -> Table:
    """The bigger model, untrained: speed and memory alone."""
    shape = grid.big
    return Table(
        "peers", f"trl-{millions:g}m", f"Against TRL on one GRPO job: a ~{millions:g}M-parameter "
        f"Llama ({grid.big_steps} steps, {grid.repeats} interleaved repeats)", SPEED,
        [_speed_cells(results, name) for name in RUNTIMES], _ratios(results), BASELINE,
        [f"{MEDIANS} Randomly initialised (hidden {shape.hidden}, {shape.layers} layers): no "
         "reward to learn, every completion 8 tokens long; the settings as in the table above."],
    )  # fmt: skip


# ----------------------------------------------------------------------------- the program


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, one repeat")
    args = parser.parse_args()
    missing = trl_missing()
    if missing:
        print(missing)
        return 0
    import tempfile

    grid = GRIDS["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        for table in run_grid(grid, Path(tmp), print):
            print("\n".join(markdown_table(table, plot=False)))
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
