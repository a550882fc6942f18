"""What the loop template costs per step, and what it adds to a real SFT step: the
``overhead`` suite of ``corun bench``, and a program of its own::

    python -m benchmarks.overhead            # full: under 3 minutes on 2 idle cores
    python -m benchmarks.overhead --quick    # smoke mode: about 20 s (--json PATH: figures)

Each on asyncio and trio, with ``loop.compute`` = ``thread`` and ``inline``:

1. **Runtime cost per step** (µs): ``corun.run`` with :class:`NoopTrainer`, whose hooks
   return ``{}``: what is left is the template's own work (admission, the producer
   stream, thread hops, the trace, the metrics and events writes).
2. **SFT through run vs a plain loop** (ms): the ``sft`` recipe's model (batch 64, no
   eval) through ``corun.run``, against a hand-written ``rollout → backward → clip →
   step`` loop over the same hooks and optimizer (:func:`plain_intervals`),
   interleaved ``plain, run, ..., plain`` (variants rotated each repeat) so load and
   drift fall on both sides. The target: a template share under 2 %.

A per-step figure is the mean step-to-step interval over steps 2..N (``step`` events'
``t``; ``perf_counter`` for the plain loop). "median-step" compares median intervals
(a burst of load barely moves them); "noise": how far a plain measurement lies from
the plain median, below which overheads are not resolved.

Each SFT measurement of the full grid runs in a fresh interpreter (``--measure``;
``corun bench --quick`` measures in its own process, as ``--in-process``): libgomp keeps an
OpenMP thread team per OS thread that ran a parallel op, and two live teams with more
threads than cores slow every parallel region (thread compute after a plain loop in
one process: ~50-70 % slower on 2 cores; ``--in-process`` shows it). A measurement
other processes disturbed is repeated (benchmarks/quiet.py; not in ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch

from benchmarks import quiet
from benchmarks.quiet import BUSY_CPUS, Guarded, Measure, OtherLoad, Request
from benchmarks.report import Note, Table, fmt, markdown_table
from corun.base.config import Config, TrainerConfig
from corun.base.rng import rollout_generator, seed_everything
from corun.contract.config_file import config_from_dict
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import Batch, Part, RolloutContext, SetupContext, Trainer
from corun.loop.template import run
from corun.records.events import EVENTS_FILE, read_records

TORCH_THREADS = 2
TARGET_PCT = 2.0
Variant = tuple[str, str]  # (backend, compute)
VARIANTS: list[Variant] = [(b, c) for b in ("asyncio", "trio") for c in ("thread", "inline")]
# The sft recipe's model, without eval.
SFT_TRAINER = {"kind": "sft", "task": "sort", "d_model": 128, "n_layers": 2, "n_heads": 4}
SFT_BATCH = 64


@dataclass(frozen=True)
class Settings:
    mode: str
    noop_steps: int
    noop_repeats: int
    sft_steps: int
    sft_repeats: int
    # A plain measurement after every run; else only before the first and after the last.
    plain_between: bool = True
    retries: int = 3  # repeats of a measurement that other processes disturbed


FULL = Settings("full", noop_steps=2000, noop_repeats=3, sft_steps=100, sft_repeats=3)
QUICK = Settings("quick", 200, 1, sft_steps=10, sft_repeats=1, plain_between=False, retries=0)
GRIDS = {"full": FULL, "quick": QUICK,
         "tiny": Settings("tiny", 50, 1, 4, 1, plain_between=False, retries=0)}  # fmt: skip


@dataclass
class NoopRow:
    backend: str
    compute: str
    steps: int
    us_per_step: float  # median over the repeats of the mean step time
    samples_us: list[float]
    tree: str | None = None  # another checkout's figure (--against), else this corun's


@dataclass
class SFTRow:
    backend: str
    compute: str
    steps: int
    plain_ms: float  # median over all plain measurements of their mean step time
    run_ms: float  # median over this variant's runs of their mean step time
    overhead_pct: float  # run_ms / plain_ms - 1
    median_step_overhead_pct: float  # the same with each measurement's median step interval
    template_pct: float  # the no-op run's µs/step over the plain step: the template's own cost
    target_met: bool
    run_samples_ms: list[float]


@dataclass
class SFTResult:
    rows: list[SFTRow]
    noise_pct: float
    plain_samples_ms: list[float]


class NoopTrainer(Trainer[TrainerConfig]):
    """Hooks that do nothing, as plain functions: what is left is the runtime."""

    def rollout(self, inputs: Any, ctx: RolloutContext) -> dict[str, float]:
        return {}

    def train_step(self, batch: Batch) -> dict[str, float]:
        return {}


NOOP_KIND = f"{NoopTrainer.__module__}:{NoopTrainer.__qualname__}"


# ----------------------------------------------------------------------------- one measurement


def _config(
    run_dir: Path, trainer: dict[str, Any], steps: int, compute: str, lane_threads: int = 0,
    adapt_threads: bool = False,
) -> Config:  # fmt: skip
    loop = {"baseline_eval": False, "eval_interval": 0, "compute": compute,
            "lane_threads": lane_threads, "adapt_threads": adapt_threads}  # fmt: skip
    return config_from_dict({
        "run": {"dir": str(run_dir), "steps": steps, "seed": 0}, "loop": loop,
        "log": {"progress": "off", "wandb": "disabled"}, "data": {"batch_size": SFT_BATCH},
        "trainer": trainer,
    })  # fmt: skip


def run_intervals(trainer: Trainer[Any], config: Config, backend: str) -> list[float]:
    """``corun.run`` to the end; the step-to-step intervals it recorded."""
    anyio.run(run, trainer, config, backend=backend)
    times = [r["t"] for r in read_records(config.run_dir / EVENTS_FILE) if r["event"] == "step"]
    if len(times) < 2:
        raise RuntimeError(f"{config.run_dir}: fewer than two step events")
    return [b - a for a, b in pairwise(times)]


def plain_intervals(config: Config) -> list[float]:
    """A hand-written loop over the trainer's hooks and optimizer (seed, build, then
    rollout → zero_grad → loss → backward → clip → step, the loss read as a number for
    logging); its step-to-step intervals."""
    seed_everything(config.run.seed)
    trainer = resolve_trainer(config.trainer.kind)(config)
    ctx = SetupContext(config)
    trainer.setup(ctx)
    (optimizer,) = ctx.optimizers
    data, ends = trainer.dataset(), []
    for index in range(config.run.steps):
        generator = rollout_generator(config.run.seed, index, 0)
        batch = trainer.rollout(data.batch(index), RolloutContext(index, generator))
        optimizer.optimizer.zero_grad(set_to_none=True)
        loss, _ = trainer.loss(batch, Part())
        torch.autograd.backward(loss)
        float(loss.detach())
        torch.nn.utils.clip_grad_norm_(optimizer.params, optimizer.grad_clip)
        optimizer.optimizer.step()
        ends.append(time.perf_counter())
    return [b - a for a, b in pairwise(ends)]


def measure(request: Request) -> list[float]:
    """One measurement in this process: ``noop``, ``plain`` (SFT) or ``run`` (SFT)."""
    run_dir, steps, compute = Path(request["run_dir"]), request["steps"], request["compute"]
    if request["what"] == "noop":
        config = _config(run_dir, {"kind": NOOP_KIND}, steps, compute)
        return run_intervals(NoopTrainer(config), config, request["backend"])
    config = _config(run_dir, SFT_TRAINER, steps, compute, request.get("lane_threads", 0),
                     request.get("adapt_threads", False))  # fmt: skip
    if request["what"] == "plain":
        return plain_intervals(config)
    return run_intervals(resolve_trainer("sft")(config), config, request["backend"])


def in_fresh_process(request: Request) -> list[float]:
    """:func:`measure` in a new interpreter, whatever this process has done."""
    threads = str(torch.get_num_threads())
    return [float(x) for x in quiet.in_fresh_interpreter("overhead", request, "--threads", threads)]


# ----------------------------------------------------------------------------- the figures


def measure_noop(
    settings: Settings, scratch: Path, measure_one: Measure, tree: Path | None = None
) -> list[NoopRow]:
    """The no-op cost per step per variant; with ``tree`` (an older checkout) its figure
    beside each, measured in turn with this corun's (in a fresh process of its own)."""
    trees = [None] if tree is None else [None, str(tree)]
    samples: dict[tuple[Variant, str | None], list[float]] = {}
    for repeat in range(settings.noop_repeats):
        for backend, compute in quiet.rotated(VARIANTS, repeat):
            for which in trees if repeat % 2 == 0 else trees[::-1]:
                run_dir = scratch / f"noop-{backend}-{compute}-{repeat}{'-other' if which else ''}"
                intervals = measure_one({
                    "what": "noop", "steps": settings.noop_steps, "backend": backend,
                    "compute": compute, "run_dir": str(run_dir),
                } | ({"tree": which} if which else {}))  # fmt: skip
                us = statistics.fmean(intervals) * 1e6
                samples.setdefault(((backend, compute), which), []).append(us)
    return [NoopRow(b, c, settings.noop_steps, statistics.median(s), [round(x, 2) for x in s], t)
            for ((b, c), t), s in samples.items()]  # fmt: skip


def measure_sft(
    settings: Settings, scratch: Path, measure_one: Measure, noop: list[NoopRow]
) -> SFTResult:
    """Interleaved plain, run, plain, run, ..., plain, each measured by ``measure_one``."""
    steps = settings.sft_steps
    names = iter(range(10**6))

    def plain() -> list[float]:
        run_dir = str(scratch / f"plain-{next(names)}")
        return measure_one(
            {"what": "plain", "steps": steps, "compute": "inline", "run_dir": run_dir}
        )

    plains = [plain()]
    runs: dict[Variant, list[list[float]]] = {v: [] for v in VARIANTS}
    for repeat in range(settings.sft_repeats):
        for backend, compute in quiet.rotated(VARIANTS, repeat):
            run_dir = str(scratch / f"sft-{backend}-{compute}-{repeat}")
            runs[(backend, compute)].append(measure_one({
                "what": "run", "steps": steps, "backend": backend, "compute": compute,
                "run_dir": run_dir,
            }))  # fmt: skip
            if settings.plain_between:
                plains.append(plain())
    if not settings.plain_between:
        plains.append(plain())

    plain_mean = statistics.median(statistics.fmean(p) for p in plains)
    noop_us = {(n.backend, n.compute): n.us_per_step for n in noop}
    plain_median = statistics.median(statistics.median(p) for p in plains)
    rows = []
    for variant, samples in runs.items():
        run_mean = statistics.median(statistics.fmean(r) for r in samples)
        run_median = statistics.median(statistics.median(r) for r in samples)
        template_pct = noop_us[variant] / (plain_mean * 1e6) * 100
        rows.append(SFTRow(
            *variant, steps=steps, plain_ms=plain_mean * 1e3, run_ms=run_mean * 1e3,
            overhead_pct=round((run_mean / plain_mean - 1) * 100, 3),
            median_step_overhead_pct=round((run_median / plain_median - 1) * 100, 3),
            template_pct=round(template_pct, 3), target_met=template_pct < TARGET_PCT,
            run_samples_ms=[round(statistics.fmean(r) * 1e3, 3) for r in samples],
        ))  # fmt: skip
    plain_means = [statistics.fmean(p) for p in plains]
    spread = statistics.median(abs(m / plain_mean - 1) for m in plain_means) * 100
    return SFTResult(rows, spread, [round(m * 1e3, 3) for m in plain_means])


# ----------------------------------------------------------------------------- the tables


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench overhead``: the no-op cost per step, then SFT through run vs plain."""
    settings = GRIDS[grid]
    note(f"no-op trainer, {settings.noop_steps} steps x 4 variants")
    in_process = Guarded(measure, settings.retries)  # retries: the full grid's
    noop = measure_noop(settings, scratch, in_process)
    # The quick and test grids measure SFT in this process: no interpreter to start per
    # measurement, but thread compute after a plain loop pays for a second OpenMP thread
    # team (see the module's doc).
    here = grid != "full"
    measure_one = in_process if here else Guarded(in_fresh_process, settings.retries)
    note(f"SFT through run vs a plain loop, {settings.sft_steps} steps")
    sft = measure_sft(settings, scratch, measure_one, noop)
    aside = f" Measured in this process ({grid} grid)." if here else ""
    return tables(noop, sft, measure_one.retried, measure_one.disturbed, aside)


def tables(
    noop: list[NoopRow], sft: SFTResult, retried: int, disturbed: int, aside: str = ""
) -> list[Table]:
    base = next(r.us_per_step for r in noop if (r.backend, r.compute) == ("asyncio", "thread"))
    noop_table = Table(
        "overhead", "noop", "Template cost per step (no-op trainer)",
        ["backend", "compute", "µs per step", "vs asyncio/thread"],
        [[r.backend, r.compute, fmt(r.us_per_step, 0), f"{r.us_per_step / base:.2f}"]
         for r in noop],
        [(f"{r.backend}/{r.compute}", r.us_per_step / base) for r in noop],
        "asyncio with thread compute (the default), same run",
    )  # fmt: skip
    sft_table = Table(
        "overhead", "sft", "SFT step (the sft recipe's model) through corun.run vs a plain loop",
        ["backend", "compute", "plain ms", "run ms", "run / plain", "template share"],
        [[r.backend, r.compute, fmt(r.plain_ms), fmt(r.run_ms), f"{r.run_ms / r.plain_ms:.3f}",
          f"{r.template_pct:.1f} %"] for r in sft.rows],
        [(f"{r.backend}/{r.compute}", r.run_ms / r.plain_ms) for r in sft.rows],
        "the plain PyTorch loop, measured in the same run",
        [f"A plain measurement lies {sft.noise_pct:.1f} % from the plain median (noise); "
         f"{retried} measurement(s) repeated for other processes' load, {disturbed} still "
         f"disturbed.{aside}"],
    )  # fmt: skip
    return [noop_table, sft_table]


# ----------------------------------------------------------------------------- the program


def print_report(head: dict[str, Any], noop: list[NoopRow], sft: SFTResult) -> None:
    """The suite's tables, and what the figures in the JSON add to them."""
    print(f"corun overhead ({head['mode']}): the runtime cost per step and what it adds to an "
          f"SFT step; torch {head['torch']} ({head['torch_threads']} threads), python "
          f"{head['python']}, anyio {head['anyio']}, trio {head['trio']}, {head['cpus']} CPUs, "
          f"load {head['load_avg_1m']} at start; SFT {head['sft_isolation']}\n")  # fmt: skip
    for table in tables(noop, sft, head["retried"], head["disturbed"]):
        print("\n".join(markdown_table(table, plot=False)))
    for s in sft.rows:
        print(
            f"{s.backend}/{s.compute}: template share {s.template_pct:.2f} % (target < "
            f"{TARGET_PCT:g} %: {'met' if s.target_met else 'NOT met'}); run vs plain "
            f"{s.overhead_pct:+.2f} %, median step {s.median_step_overhead_pct:+.2f} %"
        )
    others = head["other_processes_cpus"]
    print("other processes: not watched (no /proc/stat)" if others is None else
          f"other processes kept {others:.2f} CPUs busy on average (> {BUSY_CPUS:g}: "
          "figures unreliable, rerun on an idle machine)")  # fmt: skip


def print_comparison(rows: list[NoopRow], tree: Path) -> None:
    print(f"\nno-op cost per step: this corun vs {tree} (interleaved, each in a fresh process "
          f"of its own)\n{'backend':8} {'compute':8} {'before µs':>10} {'now µs':>9} "
          f"{'now/before':>11}")  # fmt: skip
    for now, before in zip(rows[::2], rows[1::2], strict=True):
        print(
            f"{now.backend:8} {now.compute:8} {before.us_per_step:10.1f} "
            f"{now.us_per_step:9.1f} {now.us_per_step / before.us_per_step:11.3f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke mode: few steps, 1 repeat")
    add("--json", metavar="PATH", type=Path, help="also write the figures here")
    add("--in-process", action="store_true", help="SFT in this process (see the module doc)")
    add("--threads", type=int, default=TORCH_THREADS, help="torch intra-op threads (default 2)")
    add(
        "--against",
        metavar="TREE",
        type=Path,
        help="also compare the no-op cost per step "
        "with another checkout (e.g. a worktree of an older commit), side by side",
    )
    add("--measure", metavar="REQUEST", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure:  # a child of in_fresh_process: one measurement, one JSON line
        print(json.dumps(measure(json.loads(args.measure))))
        return 0

    settings = QUICK if args.quick else FULL
    head: dict[str, Any] = {
        **asdict(settings), "sft_isolation": "in-process" if args.in_process
        else "a fresh process per measurement", "torch": str(torch.__version__),
        "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
        "anyio": version("anyio"), "trio": version("trio"), "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    others = OtherLoad()
    in_process = Guarded(measure, settings.retries)
    isolated = Guarded(in_fresh_process, settings.retries)
    with tempfile.TemporaryDirectory(prefix="corun-overhead-") as scratch:
        noop = measure_noop(settings, Path(scratch), in_process)
        sft = measure_sft(settings, Path(scratch), in_process if args.in_process else isolated,
                          noop)  # fmt: skip
        compared = (
            []
            if args.against is None
            else measure_noop(  # run directories of their own
                settings, Path(tempfile.mkdtemp(dir=scratch)), isolated, args.against.resolve()
            )
        )
    head["other_processes_cpus"] = others.stop()
    for field in ("measured", "retried", "disturbed"):
        head[field] = getattr(in_process, field) + getattr(isolated, field)
    print_report(head, noop, sft)
    if compared:
        print_comparison(compared, args.against)
    if args.json is not None:
        figures = {
            **head, "timing": "step-to-step: events.jsonl `t` (run), perf_counter (plain)",
            "noop": [asdict(n) for n in noop], "sft": [asdict(s) for s in sft.rows],
            "sft_plain_samples_ms": sft.plain_samples_ms,
            "sft_noise_pct": round(sft.noise_pct, 3), "target_pct": TARGET_PCT,
            "target_met": all(s.target_met for s in sft.rows),
            "against": [asdict(c) for c in compared] or None,
        }  # fmt: skip
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(figures)) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
