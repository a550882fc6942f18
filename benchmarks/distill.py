"""``corun bench distill``: on-policy distillation against GRPO from the same start.

The shipped recipes, each run a fresh ``corun train`` process in one scratch folder:
the teacher (hf_distill_teacher.toml) and the student's warm start (hf_sft.toml) are
trained first, then hf_distill and hf_grpo from that start, each evaluated every
``eval_every`` steps on the same held-out prompts (greedy, 512). Figures: each run's
final held-out reward, and the steps and training seconds (evaluations excluded) to
reach GRPO's final reward and to close half the gap from the start to the teacher's.

::

    python -m benchmarks.distill           # the recipes as shipped: ~7 minutes
    python -m benchmarks.distill --quick   # a 200-step teacher, 60 steps each

Nothing is asserted; measure on a quiet machine.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from benchmarks.peers import ENV, training_curve
from benchmarks.report import Note, Table, fmt
from benchmarks.suite import main_of
from corun.recipes import shipped
from corun.records.events import read_records


@dataclass(frozen=True)
class Grid:
    teacher_steps: int | None  # None: the recipes' own
    student_steps: int | None
    distill_steps: int | None
    grpo_steps: int | None
    eval_every: int


GRIDS = {
    "full": Grid(None, None, None, None, 50),
    "quick": Grid(200, 100, 60, 60, 20),
    "tiny": Grid(6, 4, 2, 2, 1),
}


def recipe(scratch: Path, name: str, steps: int | None) -> Path:
    """The shipped recipe ``name`` (a checkout's configs/, or the installed package's),
    or a copy of it under ``scratch`` cut to ``steps``."""
    found = shipped(name)
    assert found is not None, f"no shipped recipe {name}"
    if steps is None:
        return found
    config = tomllib.loads(found.read_text())
    config["run"]["steps"] = steps
    config["loop"].update(eval_interval=steps, save_interval=steps, lr_schedule="constant")
    config["trainer"]["eval_size"] = min(config["trainer"].get("eval_size", 512), 64)
    copy = scratch / f"{name}-{steps}.toml"
    copy.write_text(tomli_w.dumps(config))
    return copy


def train(scratch: Path, name: str, overrides: list[str]) -> Path:
    """``corun train`` of a shipped recipe in ``scratch`` (its warm starts trained there
    first); its run directory."""
    out = scratch / f"bench-{name}"
    command = [sys.executable, "-m", "corun", "train", name, f"run.dir={out}",
               "log.progress=off", *overrides]  # fmt: skip
    done = subprocess.run(command, cwd=scratch, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"corun train {name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return out


def final_reward(run: Path) -> float:
    return float([m for m in read_records(run / "metrics.jsonl") if "eval/reward" in m][-1]
                 ["eval/reward"])  # fmt: skip


def reached(curve: list[tuple[int, float, float]], target: float) -> tuple[str, str]:
    """Steps and training seconds to the first evaluation at ``target`` or above."""
    hit = next(((step, t) for step, t, value in curve if step > 0 and value >= target), None)
    return ("not reached", "—") if hit is None else (str(hit[0]), fmt(hit[1], 1))


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    grid = GRIDS[grid_name]
    teacher = recipe(scratch, "hf_distill_teacher", grid.teacher_steps)
    student = recipe(scratch, "hf_sft", grid.student_steps)
    starts = [f"trainer.init_from={student}", f"loop.eval_interval={grid.eval_every}",
              "loop.save_interval=0"]  # fmt: skip
    runs: dict[str, Path] = {}
    for name, steps in (("hf_distill", grid.distill_steps), ("hf_grpo", grid.grpo_steps)):
        note(f"{name} from the same warm start (its warm starts trained first)")
        extra = [f"trainer.teacher_from={teacher}"] if name == "hf_distill" else []
        extra += [] if steps is None else [f"run.steps={steps}"]
        runs[name] = train(scratch, name, starts + extra)
    curves = {name: training_curve(run)[1] for name, run in runs.items()}
    start = curves["hf_grpo"][0][2]
    teacher_reward = final_reward(scratch / "runs" / teacher_run_name(teacher))
    targets = {"GRPO's final": curves["hf_grpo"][-1][2],
               "half the gap to the teacher": (start + teacher_reward) / 2}  # fmt: skip
    return [figures_table(curves, targets, start, teacher_reward)]


def teacher_run_name(config: Path) -> str:
    return str(tomllib.loads(config.read_text())["run"]["name"])


def figures_table(
    curves: dict[str, list[tuple[int, float, float]]], targets: dict[str, float],
    start: float, teacher: float,
) -> Table:  # fmt: skip
    columns = ["trainer", "steps", "training s", "final held-out reward"]
    for label, value in targets.items():
        columns += [f"steps to {label} ({value:.3f})", f"s to {label}"]
    rows: list[list[str]] = []
    seconds: dict[str, float] = {}
    grpo_target = targets["GRPO's final"]
    for name, curve in curves.items():
        step, t, final = curve[-1]
        row = [name, str(step), fmt(t, 1), f"{final:.3f}"]
        for value in targets.values():
            row += list(reached(curve, value))
        rows.append(row)
        hit = next((t for s, t, v in curve if s > 0 and v >= grpo_target), None)
        if hit is not None:
            seconds[name] = hit
    ratios = [(name, seconds[name] / seconds["hf_grpo"]) for name in seconds
              if seconds.get("hf_grpo")]  # fmt: skip
    notes = [f"Held-out reward at the start {start:.3f}; the teacher's {teacher:.3f}."]
    return Table("distill", "time-to-reward", "Distillation against GRPO, same start",
                 columns, rows, ratios, "hf_grpo's training seconds to its final reward",
                 notes)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main_of("distill", __doc__.splitlines()[0]))
