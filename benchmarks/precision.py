"""LoRA and bfloat16 against full float32 on the same GRPO run: the ``precision`` suite
of ``corun bench``, and a program of its own::

    python -m benchmarks.precision            # 3 seeds x 600 steps of each: ~30 min
    python -m benchmarks.precision --quick    # 1 seed x 20 steps

Each variant is the ``hf_grpo`` recipe (GRPO of the built-in tiny Llama from its SFT
warm start, the transformers engine generating, the rate decayed by cosine) in a fresh
``corun train`` process: ``float32`` as shipped, ``bfloat16`` with
``trainer.dtype=bfloat16``, and ``lora`` with ``trainer.lora.rank=8`` (the adapters on
the attention and MLP projections at their own rates: ``trainer.lora.lr_scale`` and
``b_lr_ratio``). Printed: each variant's held-out numeric match at the last step, the
mean over the seeds with its standard error (over seeds), and the ratio to float32's
mean, measured in the same run. Nothing is asserted: a learning figure over
seeds is a benchmark's, and the recipes' own figures are tests/test_recipe_figures.py's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import Note, Table, fmt
from corun.records.events import read_records

RECIPE = "hf_grpo"
VARIANTS = {  # name: overrides of the recipe
    "float32": (),
    "bfloat16": ("trainer.dtype=bfloat16",),
    "lora": ("trainer.lora.rank=8",),
}
GRIDS = {"full": (3, 600), "quick": (1, 20), "tiny": (1, 4)}  # seeds, steps


def final_reward(variant: str, seed: int, steps: int, scratch: Path) -> float:
    """One ``corun train`` of the variant; its held-out reward at the last step."""
    run_dir = scratch / f"{variant}-{seed}"
    command = [
        sys.executable, "-m", "corun", "train", RECIPE, *VARIANTS[variant],
        f"run.seed={seed}", f"run.steps={steps}", f"run.dir={run_dir}",
        f"loop.eval_interval={min(steps, 100)}", f"loop.save_interval={steps}", "log.progress=off",
    ]  # fmt: skip
    subprocess.run(command, cwd=scratch, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    rows = read_records(run_dir / "metrics.jsonl")
    return float([row for row in rows if "eval/reward" in row][-1]["eval/reward"])


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error over seeds (0 for one seed)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, statistics.stdev(values) / len(values) ** 0.5


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench precision``: LoRA and bf16 against float32, over seeds."""
    seeds, steps = GRIDS[grid]
    finals: dict[str, list[float]] = {}
    for variant in VARIANTS:
        for seed in range(seeds):
            note(f"{RECIPE} {variant}, seed {seed}: {steps} steps")
            finals.setdefault(variant, []).append(final_reward(variant, seed, steps, scratch))
    base = mean_se(finals["float32"])[0]
    rows, ratios = [], []
    for variant, values in finals.items():
        mean, se = mean_se(values)
        rows.append([variant, " ".join(f"{v:.3f}" for v in values), fmt(mean, 3), fmt(se, 3),
                     f"{mean / base:.2f}"])  # fmt: skip
        ratios.append((variant, mean / base))
    return [Table(
        "precision", "final", f"{RECIPE}: held-out numeric match after {steps} steps",
        ["variant", "per seed", "mean", "SE (seeds)", "/ float32"], rows, ratios,
        "float32's mean final reward, same run",
        [f"{seeds} seed(s) from 0; the SFT warm start is shared (trained once, float32). "
         "lora: rank 8 on the attention and MLP projections, A at trainer.lora.lr_scale "
         "times the recipe's rate and B at b_lr_ratio times A's (LoRA+)."],
    )]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 seed x 20 steps")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        for table in suite("quick" if args.quick else "full", Path(scratch), print):
            print(table.title)
            for row in [table.columns, *table.rows]:
                print("  ".join(f"{cell:>12}" for cell in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
