"""What each shipped recipe learns, measured: ``python -m benchmarks.recipes [NAME ...]
[--write]``.

Each :class:`Check` names a recipe of ``configs/`` (or an example's config by its path
in the repository, ``examples/loo.toml``, run with the repository on ``PYTHONPATH``
as its docs say), the held-out metric its row of docs/recipes.md quotes, and for a
recipe too slow for CI the overrides of a shorter twin (measured and documented
beside it). A measurement trains the recipe (or twin)
with ``corun train`` in a scratch folder, its warm starts first as the recipe names
them, and reads the metric at the first and the last evaluation from the run's
``metrics.jsonl``. Its standard error is the trainer's own (``<metric>_se``) where it
reports one, else the binomial bound sqrt(p(1 - p) / n) over the ``n`` held-out
examples (every metric here is a mean of values in [0, 1]).

``--seeds K`` measures each check at the seeds 0 .. K-1, one pass per seed in a folder
of its own, so a recipe's warm starts measured in the same pass are trained at that
seed too. A training trajectory is chaotic: the float kernels of another CPU (AVX2
against AVX-512) move a recipe's figure about as far as another seed does. So a
documented figure is the mean of its runs (seeds, machines: ``--add`` keeps the runs
stored before and adds these), and the spread of the runs is kept beside it.

``--write`` stores the figures in ``benchmarks/recipe_figures.json`` and regenerates
docs/recipes.md's table from them (between its ``recipe-figures`` markers): the table
is never typed by hand. tests/test_recipe_figures.py trains every check again (at the
recipe's own seed) and fails when a figure moved by more than ``TOLERANCE_SE``
standard errors of the difference, naming the recipe, both figures and the tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from corun.records.events import read_records

ROOT = Path(__file__).resolve().parents[1]
FIGURES = Path(__file__).with_name("recipe_figures.json")
DOCS = ROOT / "docs" / "recipes.md"
BEGIN, END = "<!-- recipe-figures:begin -->", "<!-- recipe-figures:end -->"
# docs/writing-a-trainer.md quotes its example's figure between these, generated too.
EXAMPLE, EXAMPLE_DOCS = "examples/loo.toml", ROOT / "docs" / "writing-a-trainer.md"
EXAMPLE_BEGIN, EXAMPLE_END = "<!-- example-figure:begin -->", "<!-- example-figure:end -->"
TOLERANCE_SE = 3.0  # a figure may move this many standard errors of the difference


@dataclass(frozen=True)
class Check:
    """A recipe's figure; a check with a ``twin`` stands in for its recipe in CI when
    the recipe has a check of its own too (tests mark that one ``long``)."""

    recipe: str  # configs/<recipe>.toml, or an example's config: "examples/<name>.toml"
    metric: str  # the held-out metric its docs row quotes
    n: int  # held-out examples behind the metric (its binomial standard error)
    twin: tuple[str, ...] = ()  # overrides of a shorter twin for CI; () the recipe itself
    label: str = ""  # what the metric is, in the docs table
    needs: tuple[str, ...] = ()  # overrides every measurement of it takes (where things are)

    @property
    def name(self) -> str:
        return f"{self.recipe} (twin)" if self.twin else self.recipe

    @property
    def config(self) -> str:
        """What ``corun train`` is given: a recipe's name, or an example's full path."""
        return str(ROOT / self.recipe) if self.is_example else self.recipe

    @property
    def is_example(self) -> bool:
        return "/" in self.recipe

    @property
    def has_twin(self) -> bool:
        """Whether CI measures a shorter twin instead of this check."""
        return not self.twin and any(c.recipe == self.recipe and c.twin for c in CHECKS)

    @property
    def in_ci(self) -> bool:
        """Whether the test suite runs this check by default (the rest: ``-m long``)."""
        return not self.has_twin and self.recipe not in LONG_ONLY


# Recipes whose checks run only with `-m long` (CI's 60 minutes on 2 cores do not fit
# them): a sibling recipe's trainer on another engine (vLLM) or schedule (async), which
# other tests hold to the sibling's behaviour (tests/test_vllm.py's log-probs across
# syncs, the async tests) and whose sibling's figure CI checks; and hf_agentic_sft with
# hf_agentic, whose spread over runs (docs/recipes.md) makes the tolerance so wide that
# only a collapse would fail it (tests/test_hf_agentic.py runs them end to end in CI);
# and skyrl_sft with skyrl, whose gain tests/test_skyrl.py asserts in CI, as
# tests/test_reasoning_gym.py asserts rg_grpo's over rg_sft, tests/test_verifiers.py
# hf_verifiers' and tests/test_example_trainer.py the LOO example's (200 steps).
LONG_ONLY = frozenset({"grpo_async", "agentic_async", "hf_grpo_vllm", "hf_agentic_vllm",
                       "hf_agentic_async", "hf_agentic_sft", "hf_agentic", "skyrl_sft",
                       "skyrl", "rg_sft", "rg_grpo", "hf_verifiers",
                       "examples/loo.toml"})  # fmt: skip
# The verifiers environment a measurement uses (`python -m trainers.hf.verifiers_env`
# builds it in the repository): the recipe's own path is relative to where it runs.
VERIFIERS_PYTHON = f"trainer.environment.python={ROOT / '.venv-verifiers' / 'bin' / 'python'}"


# In dependency order: a recipe after the warm starts it names, so that a measurement
# of every check trains each warm start once.
CHECKS = (
    Check("sft", "eval/accuracy", 512, label="exact match"),
    Check("sft_warmup", "eval/accuracy", 512, label="exact match"),
    Check("grpo", "eval/accuracy", 512, label="exact match"),
    Check("grpo", "eval/accuracy", 512, ("run.steps=100",), "exact match"),
    Check("ppo", "eval/accuracy", 512, label="exact match"),
    Check("ppo", "eval/accuracy", 512, ("run.steps=100",), "exact match"),
    Check(
        "grpo_async",
        "eval/accuracy",
        512,
        ("loop.version_schedule=fixed",),
        "exact match, fixed version schedule",
    ),
    Check("diffusion_pretrain", "eval/reward", 72, label="image reward"),
    Check("flow_grpo", "eval/reward", 72, label="image reward"),
    Check("flow_grpo", "eval/reward", 72, ("run.steps=50",), "image reward"),
    Check("pe_warmup", "eval/rewrite_exact", 72, label="exact rewrites"),
    Check("pe", "eval/reward", 72, label="image reward"),
    Check("pe", "eval/reward", 72, ("run.steps=100",), "image reward"),
    Check("unified_pretrain", "eval/text/accuracy", 256, label="text exact match"),
    Check("unified", "eval/text/accuracy", 256, label="text exact match"),
    Check("agentic_sft", "eval/success", 256, label="success"),
    Check("agentic", "eval/success", 256, label="success"),
    Check("agentic", "eval/success", 256, ("run.steps=20",), "success"),
    Check("agentic_async", "eval/success", 256, ("loop.version_schedule=fixed",), "success"),
    Check("hf_sft", "eval/reward", 512, label="numeric match"),
    Check("hf_grpo_vllm", "eval/reward", 512, label="numeric match"),
    Check("hf_grpo_vllm", "eval/reward", 512, ("run.steps=200",), "numeric match"),
    Check("hf_grpo", "eval/reward", 512, label="numeric match"),
    Check("hf_grpo", "eval/reward", 512, ("run.steps=200",), "numeric match"),
    Check("hf_ppo", "eval/reward", 512, label="numeric match"),
    Check("hf_distill_teacher", "eval/reward", 512, label="numeric match"),
    Check("hf_distill", "eval/reward", 512, label="numeric match"),
    Check("hf_agentic_sft", "eval/success", 256, label="success"),
    Check("hf_agentic", "eval/success", 256, label="success"),
    Check("hf_agentic", "eval/success", 256, ("run.steps=20",), "success"),
    Check("hf_agentic_vllm", "eval/success", 256, label="success"),
    Check("hf_agentic_vllm", "eval/success", 256, ("run.steps=20",), "success"),
    Check("hf_agentic_async", "eval/success", 256, label="success"),
    Check("hf_agentic_async", "eval/success", 256, ("run.steps=30",), "success"),
    Check("skyrl_sft", "eval/success", 256, label="success"),
    Check("skyrl", "eval/reward", 256, label="env reward"),
    Check("rg_sft", "eval/reward", 512, label="reasoning-gym task score"),
    Check("rg_grpo", "eval/reward", 512, label="reasoning-gym task score"),
    Check("hf_verifiers", "eval/reward", 512, label="numeric match", needs=(VERIFIERS_PYTHON,)),
    # docs/writing-a-trainer.md's example, whose figure that page quotes (generated).
    Check("examples/loo.toml", "eval/accuracy", 512, label="exact match"),
)


@dataclass(frozen=True)
class Figure:
    """One run of a check."""

    start: float  # the metric at the first evaluation
    final: float  # ... at the last
    se: float  # the final figure's standard error (the held-out set's sampling)
    steps: int
    wall_s: float  # the command's wall time, warm starts trained on the way included
    seed: int = 0


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A documented figure: the mean of ``runs`` (stored run records) and their spread."""
    finals = [float(run["final"]) for run in runs]
    return {
        "start": statistics.fmean(float(run["start"]) for run in runs),
        "final": statistics.fmean(finals),
        "se": statistics.fmean(float(run["se"]) for run in runs),
        "spread": statistics.stdev(finals) if len(runs) > 1 else 0.0,
        "steps": int(runs[-1]["steps"]),
        "wall_s": round(statistics.fmean(float(run["wall_s"]) for run in runs), 1),
        "runs": list(runs),
    }


def standard_error(value: float, n: int, reported: float | None) -> float:
    """The trainer's own standard error when it reports one, else the binomial bound."""
    if reported is not None:
        return reported
    return math.sqrt(max(value * (1.0 - value), 0.0) / n)


def final_metric(run_dir: Path, check: Check) -> Figure:
    """The check's metric at the first and last evaluation of ``run_dir``."""
    rows = read_records(run_dir / "metrics.jsonl")
    evals = [row for row in rows if check.metric in row and "perf/eval_time_s" in row]
    if not evals:
        raise RuntimeError(f"{check.name}: no evaluation of {check.metric} in {run_dir}")
    last = evals[-1]
    value = float(last[check.metric])
    se = standard_error(value, check.n, last.get(f"{check.metric}_se"))
    return Figure(float(evals[0][check.metric]), value, se, int(last["step"]), 0.0)


def measure(
    check: Check, scratch: Path, extra: Sequence[str] = (), seed: int | None = None
) -> Figure:
    """Train the check's recipe (or twin) with ``corun train`` in ``scratch``, with
    ``extra`` overrides (and at ``seed``, else the recipe's own); its figure. Warm
    starts already trained there are reused."""
    from corun import load_config  # a measurement's imports wait until it runs

    scratch.mkdir(parents=True, exist_ok=True)
    seeded = [] if seed is None else [f"run.seed={seed}"]
    overrides = [*check.needs, *check.twin, *extra, *seeded, "log.progress=off"]
    if check.twin or extra:  # its own run directory, beside the recipe's own run's
        name = load_config(check.config).run.name
        overrides.append(
            f"run.name={name}{'-twin' if check.twin else ''}{'-extra' if extra else ''}"
        )
    run_dir = load_config(check.config, overrides).run_dir
    command = [sys.executable, "-m", "corun", "train", check.config, *overrides]
    started = time.perf_counter()
    # As a user runs it: torch's default thread count (a test session caps it at 1),
    # which the figures were measured at; wandb off.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.setdefault("WANDB_MODE", "disabled")
    if check.is_example:  # its trainer is a module of the repository (examples.<name>)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        command, cwd=scratch, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{check.name}: corun train exited {done.returncode}\n{done.stderr}")
    figure = final_metric(scratch / run_dir, check)
    return Figure(figure.start, figure.final, figure.se, figure.steps, round(wall, 1), seed or 0)


def tolerance(documented: dict[str, Any], now: Figure) -> float:
    """``TOLERANCE_SE`` standard errors of ``now`` (one run) less the documented figure:
    each figure's held-out sampling, and the trajectory's spread across runs (the one
    run's own, and that of the documented mean of ``n`` runs: spread² / n)."""
    spread, n = float(documented["spread"]), len(documented["runs"])
    variance = float(documented["se"]) ** 2 + now.se**2 + spread**2 * (1.0 + 1.0 / n)
    return TOLERANCE_SE * math.sqrt(variance)


def moved(check: Check, documented: dict[str, Any], now: Figure) -> str | None:
    """Why ``now`` is not the documented figure (more than :func:`tolerance` away);
    None when it is."""
    allowed = tolerance(documented, now)
    gap = now.final - float(documented["final"])
    if abs(gap) <= allowed:
        return None
    return (
        f"{check.name}: held-out {check.metric} at step {now.steps} is {now.final:.3f} "
        f"(from {now.start:.3f}); documented {documented['final']:.3f} ± {documented['se']:.3f} "
        f"(spread {documented['spread']:.3f} over {len(documented['runs'])} runs) "
        f"(measured {', '.join(sorted({run['measured'] for run in documented['runs']}))}): "
        f"{gap:+.3f}, past the tolerance of "
        f"{allowed:.3f} ({TOLERANCE_SE:g} standard errors of the difference)"
    )


def stored() -> dict[str, dict[str, Any]]:
    """The documented figures, by check name."""
    return dict(json.loads(FIGURES.read_text())["figures"]) if FIGURES.is_file() else {}


def store(measured: dict[str, list[Figure]], add: bool) -> None:
    """Store each check's runs, stamped with the date and the machine: in place of the
    stored ones, or with ``add`` beside them (a run of the same seed on the same
    machine replaced); each figure is then the :func:`summary` of its runs."""
    document = json.loads(FIGURES.read_text()) if FIGURES.is_file() else {"figures": {}}
    today, here = datetime.date.today().isoformat(), machine()
    for name, figures in measured.items():
        new = [{**asdict(f), "measured": today, "machine": here} for f in figures]
        kept = document["figures"].get(name, {}).get("runs", []) if add else []
        mine = {(run["seed"], run["machine"]) for run in new}
        runs = [run for run in kept if (run["seed"], run["machine"]) not in mine] + new
        document["figures"][name] = summary(runs)
    order = [check.name for check in CHECKS]
    document["figures"] = dict(
        sorted(document["figures"].items(), key=lambda item: order.index(item[0]))
    )
    FIGURES.write_text(json.dumps(document, indent=1) + "\n")


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch  # the CPU capability decides float rounding, and with it the figures

    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()}, {cores} cores, torch {torch.__version__} ({capability})"


def table(figures: dict[str, dict[str, Any]]) -> str:
    """docs/recipes.md's figure table."""
    lines = [
        "| recipe | held-out metric | steps | start → end (± SE) | runs (spread) | wall |",
        "|---|---|---|---|---|---|",
    ]
    for check in CHECKS:
        figure = figures.get(check.name)
        if figure is None:
            continue
        twin = f" `{' '.join(check.twin)}`" if check.twin else ""
        lines.append(
            f"| `{check.recipe}`{twin} | {check.label} | {figure['steps']} | "
            f"{figure['start']:.3f} → {figure['final']:.3f} ± {figure['se']:.3f} | "
            f"{len(figure['runs'])} ({figure['spread']:.3f}) | {figure['wall_s']:.0f} s |"
        )
    return "\n".join(lines)


def example_figure(figures: dict[str, dict[str, Any]]) -> str:
    """docs/writing-a-trainer.md's sentence on its example's figure."""
    figure = figures[EXAMPLE]
    dates = ", ".join(sorted({str(run["measured"]) for run in figure["runs"]}))
    return (
        f"Measured by `python -m benchmarks.recipes {EXAMPLE} --write` ({dates}, "
        f"{len(figure['runs'])} run): held-out greedy exact match on 512 prompts "
        f"{figure['start']:.3f} → {figure['final']:.3f} ± {figure['se']:.3f} in "
        f"{figure['steps']} steps, {figure['wall_s']:.0f} s with the warm start."
    )


def _between(path: Path, begin: str, end: str, text: str) -> None:
    head, rest = path.read_text().split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def write_docs(document: dict[str, Any]) -> None:
    runs = [run for figure in document["figures"].values() for run in figure["runs"]]
    machines = sorted({str(run["machine"]) for run in runs})
    note = (
        "Measured by `python -m benchmarks.recipes [--seeds K] [--add] --write` on "
        f"{' and on '.join(machines)}: a figure is the mean of its runs (seeds, "
        "machines), the spread their standard deviation."
    )
    _between(DOCS, BEGIN, END, f"{note}\n\n{table(document['figures'])}")
    if EXAMPLE in document["figures"]:
        _between(EXAMPLE_DOCS, EXAMPLE_BEGIN, EXAMPLE_END, example_figure(document["figures"]))


def selected(names: Sequence[str], ci: bool) -> list[Check]:
    """The checks ``names`` select (a recipe's name its checks, ``<recipe>:twin`` its
    twin alone; none: every check), or with ``ci`` those the test suite runs."""
    return [
        c for c in CHECKS
        if (not names or c.recipe in names or (c.twin and f"{c.recipe}:twin" in names))
        and not (ci and not c.in_ci)
    ]  # fmt: skip


def measure_seeds(checks: Sequence[Check], scratch: Path, seeds: int) -> dict[str, list[Figure]]:
    """Each check's runs at the seeds 0 .. ``seeds``-1 (one pass per seed, in
    ``scratch/seed-N`` when there are several), printed as measured."""
    runs: dict[str, list[Figure]] = {check.name: [] for check in checks}
    for seed in range(seeds):
        folder = scratch if seeds == 1 else scratch / f"seed-{seed}"
        for check in checks:
            figure = measure(check, folder, seed=None if seeds == 1 else seed)
            runs[check.name].append(figure)
            print(
                f"{check.name:24} seed {seed}  {check.metric:20} {figure.start:.3f} -> "
                f"{figure.final:.3f} ± {figure.se:.3f}  {figure.steps} steps  "
                f"{figure.wall_s:.0f} s",
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recipes", description=__doc__)
    parser.add_argument("names", nargs="*", help="recipes to measure (default: every check)")
    parser.add_argument("--ci", action="store_true", help="only the checks the tests run")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per check (default 1)")
    parser.add_argument("--add", action="store_true", help="keep the stored runs, add these")
    parser.add_argument(
        "--write", action="store_true", help="store the figures and regenerate the docs table"
    )
    parser.add_argument("--scratch", type=Path, default=Path("runs/recipe-figures"))
    args = parser.parse_args(argv)
    known = {check.recipe for check in CHECKS} | {f"{c.recipe}:twin" for c in CHECKS if c.twin}
    unknown = set(args.names) - known
    if unknown:
        parser.error(f"no check for {', '.join(sorted(unknown))}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1")
    measured = measure_seeds(selected(args.names, args.ci), args.scratch, args.seeds)
    documented = stored()
    for name, figures in measured.items():
        before = documented.get(name)
        was = f"  (documented {before['final']:.3f})" if before else ""
        finals = ", ".join(f"{figure.final:.3f}" for figure in figures)
        print(f"{name:24} {finals}{was}")
    if args.write:
        store(measured, args.add)
        write_docs(json.loads(FIGURES.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
