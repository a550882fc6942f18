"""``corun bench peers``: corun against another runtime on the same job. GRPO on the
built-in word problems with the tiny Llama, warm-started from the shipped ``hf_sft``
recipe (trained first, then exported: both runtimes load the same directory), 16
prompts x 8 samples per step in the same order, the numeric-match reward, 8 new tokens,
lr 3e-4 constant, clip 0.2, no KL, token-mean loss (TRL's "dapo"), float32, the same
torch threads. Each run is a fresh process; the runtimes alternate within each repeat.

Rows: corun ``hf_grpo`` on its transformers engine; TRL's ``GRPOTrainer`` as
installed; TRL with ``OMP_WAIT_POLICY=PASSIVE`` (torch's OpenMP threads otherwise spin
between parallel regions, and stall beside another process: corun sets passive itself).
Figures: s/step and generation s/step (medians over the steps, then over the repeats),
the rest of the step, generated tokens/s, peak RSS of the process, the held-out reward
of each final model by one evaluation (:func:`held_out_reward`, here, on the exported
models), and training time to the lower of the final rewards (evaluations excluded).

::

    python -m benchmarks.peers           # 60 steps, 3 repeats: ~6 minutes
    python -m benchmarks.peers --quick   # 12 steps, 1 repeat

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

from benchmarks.report import Note, Table, fmt, markdown_table
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
class Grid:
    steps: int
    repeats: int
    eval_every: int


GRIDS = {"full": Grid(60, 3, 15), "quick": Grid(12, 1, 6), "tiny": Grid(3, 1, 3)}


def trl_missing() -> str | None:
    """One line when TRL is not installed, else None."""
    if find_spec("trl") is None:
        return "TRL is not installed: pip install -c constraints-cpu.txt -e '.[peers]'"
    return None


# ----------------------------------------------------------------------------- the job


def warm_start(scratch: Path) -> Path:
    """The shipped hf_sft recipe's final model, exported once under ``scratch``."""
    model = scratch / "warm-start"
    if not (model / "config.json").is_file():
        run_dir = scratch / "hf_sft"
        command = [sys.executable, "-m", "corun", "train", "hf_sft", f"run.dir={run_dir}",
                   "log.progress=off"]  # fmt: skip
        subprocess.run(command, check=True, env=ENV, capture_output=True)
        from trainers.hf.state import export

        export(str(run_dir), model)
    return model


def held_out_reward(model_dir: Path, n: int = EVAL_SIZE) -> tuple[float, float]:
    """The mean numeric-match reward (and its standard error) of greedy replies to the
    first ``n`` held-out word problems: what both runtimes' models are scored by."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return score(model, AutoTokenizer.from_pretrained(model_dir), n)


def score(model: Any, tokenizer: Any, n: int = EVAL_SIZE) -> tuple[float, float]:
    """:func:`held_out_reward` of a loaded model (TRL's callback scores in place)."""
    from types import SimpleNamespace

    from corun.contract.engine import Sampling
    from corun.engines.decode import generate
    from trainers.hf.policy import ChatFormat
    from trainers.hf.rewards import numeric_match
    from trainers.hf.tasks import eval_problems

    chat = ChatFormat(tokenizer)
    examples = eval_problems(n)
    greedy = Sampling(JOB.max_new_tokens, 0.0, 1.0, (chat.eos_id,))
    prompts = [chat.encode(e.prompt) for e in examples]
    made = generate(SimpleNamespace(model=model), prompts, greedy, None, chat.pad_id)
    rewards = [numeric_match(response=chat.decode(g.ids), answer=e.answer)
               for g, e in zip(made, examples, strict=True)]  # fmt: skip
    mean = statistics.fmean(rewards)
    return mean, statistics.stdev(rewards) / len(rewards) ** 0.5


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


def run_corun(model: Path, grid: Grid, out: Path) -> dict[str, Any]:
    """``corun train hf_grpo`` on the job; its figures (as :func:`run_trl`'s)."""
    command = [
        sys.executable, "-m", "corun", "train", "hf_grpo", f"run.dir={out}",
        f"trainer.model=hf:{model}", 'trainer.init_from=""', f"run.steps={grid.steps}",
        "loop.lr_schedule=constant", f"loop.eval_interval={grid.eval_every}",
        f"trainer.eval_size={EVAL_SIZE}", f"loop.lane_threads={THREADS}",
        f"loop.save_interval={grid.steps}", "log.progress=off",
    ]  # fmt: skip
    rss = measured(command, ENV)
    events = read_records(out / EVENTS_FILE)
    metrics = read_records(out / "metrics.jsonl")
    start = next(e["t"] for e in events if e["event"] == "baseline_eval")
    eval_s = {m["step"]: m["perf/eval_time_s"] for m in metrics if "perf/eval_time_s" in m}
    steps = [e for e in events if e["event"] == "step"]
    step_times = [b["t"] - a["t"] - eval_s.get(a["step"], 0.0) for a, b in pairwise(steps)]
    train_s = {
        e["step"]: e["t"] - start - sum(s for k, s in eval_s.items() if 0 < k < e["step"])
        for e in steps
    }
    generate = [m["perf/generate_time_s"] for m in metrics if "perf/generate_time_s" in m]
    tokens = [m["rollout/response_len_mean"] for m in metrics if "rollout/response_len_mean" in m]
    curve = [(m["step"], train_s.get(m["step"], 0.0), m["eval/reward"])
             for m in metrics if "eval/reward" in m]  # fmt: skip
    from trainers.hf.state import export

    final = export(str(out), out / "final-model")
    return figures(step_times, generate, tokens, rss, curve, final)


def run_trl(model: Path, grid: Grid, out: Path, passive: bool) -> dict[str, Any]:
    """TRL's GRPOTrainer on the job in a fresh ``python -m benchmarks.peers_trl``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    command = [sys.executable, "-m", "benchmarks.peers_trl", str(model), str(out),
               "--steps", str(grid.steps), "--eval-every", str(grid.eval_every),
               "--threads", str(THREADS)]  # fmt: skip
    rss = measured(command, env)
    got = json.loads((out / "figures.json").read_text())
    return figures(got["step_s"], got["generate_s"], got["tokens"], rss,
                   [tuple(p) for p in got["curve"]], out / "final-model")  # fmt: skip


def figures(
    step_s: list[float], generate_s: list[float], tokens: list[float], rss_mib: float,
    curve: list[Any], final: Path,
) -> dict[str, Any]:  # fmt: skip
    """One run's figures; the first step (warm-up: allocations, first calls) left out."""
    step = statistics.median(step_s[1:] or step_s)
    gen = statistics.median(generate_s[1:] or generate_s)
    batch = JOB.batch
    return {
        "step_s": step, "generate_s": gen, "rest_s": step - gen,
        "tokens_per_s": statistics.fmean(tokens) * batch / gen, "rss_mib": rss_mib,
        "curve": curve, "final": final,
    }  # fmt: skip


# ----------------------------------------------------------------------------- corun bench

RUNTIMES = ("corun hf_grpo", "TRL as installed", "TRL, OMP_WAIT_POLICY=PASSIVE")


def compare(grid: Grid, scratch: Path, note: Note) -> dict[str, list[dict[str, Any]]]:
    """Every runtime ``grid.repeats`` times, interleaved; each final model scored."""
    model = warm_start(scratch)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNTIMES}
    for repeat in range(grid.repeats):
        for name in RUNTIMES:
            note(f"{name}: {grid.steps} steps (repeat {repeat + 1} of {grid.repeats})")
            out = scratch / f"{name.split(',')[0].replace(' ', '-')}-{repeat}"
            if name.startswith("corun"):
                got = run_corun(model, grid, out)
            else:
                got = run_trl(model, grid, out, passive="PASSIVE" in name)
            got["reward"], got["reward_se"] = held_out_reward(got["final"])
            results[name].append(got)
    results["start"] = [{"reward": held_out_reward(model)[0]}]
    return results


def _markdown(columns: list[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])


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
    grid = GRIDS[grid_name]
    results = compare(grid, scratch, note)
    return tables(grid, results)


def tables(grid: Grid, results: dict[str, list[dict[str, Any]]]) -> list[Table]:
    def med(name: str, key: str) -> float:
        return float(statistics.median(r[key] for r in results[name]))

    # The target: TRL's final held-out reward (passive waiting, the fair set-up).
    fair = RUNTIMES[2]
    target = med(fair, "reward")
    rows, ratios = [], []
    for name in RUNTIMES:
        reached = [time_to(r["curve"], target) for r in results[name]]
        to_target = statistics.median(t for t in reached if t is not None) if all(reached) else None
        rows.append([
            name, fmt(med(name, "step_s"), 3), fmt(med(name, "generate_s"), 3),
            fmt(med(name, "rest_s"), 3), fmt(med(name, "tokens_per_s"), 0),
            fmt(med(name, "rss_mib"), 0), f"{med(name, 'reward'):.3f} ± "
            f"{med(name, 'reward_se'):.3f}", "never" if to_target is None else fmt(to_target, 1),
        ])  # fmt: skip
        ratios.append((name, med(fair, "step_s") / med(name, "step_s")))
    start = results["start"][0]["reward"]
    return [Table(
        "peers", "trl", f"Against TRL on one GRPO job ({grid.steps} steps, "
        f"{grid.repeats} interleaved repeats)",
        ["runtime", "s/step", "generation s/step", "rest s/step", "tokens/s", "peak RSS MiB",
         f"held-out reward ({start:.3f} before)", f"train s to {target:.3f}"], rows, ratios,
        "TRL with passive waiting's steps per second; above 1: faster",
        ["Medians over the steps (the first left out), then over the repeats. Held-out "
         f"reward: {EVAL_SIZE} greedy replies, one evaluation of every final model. The "
         "target: TRL's (passive) final reward; training time excludes evaluations.",
         "\nMatched settings:\n\n" + _markdown(["setting", "corun", "TRL", "matched"], MATCHED)],
    )]  # fmt: skip


# ----------------------------------------------------------------------------- the program


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps, one repeat")
    args = parser.parse_args()
    missing = trl_missing()
    if missing:
        print(missing)
        return 0
    import tempfile

    grid = GRIDS["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        (table,) = tables(grid, compare(grid, Path(tmp), print))
    print("\n".join(markdown_table(table, plot=False)))
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
