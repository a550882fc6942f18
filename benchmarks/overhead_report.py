"""The result rows of benchmarks/overhead.py and how they are printed."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import torch

from benchmarks.quiet import BUSY_CPUS

TARGET_PCT = 2.0
SFT_BATCH = 64
# A measurement that other processes disturbed (benchmarks.quiet) is repeated this often.
RETRIES = 3


@dataclass(frozen=True)
class Settings:
    mode: str
    noop_steps: int
    noop_repeats: int
    sft_steps: int
    sft_repeats: int
    # A plain measurement after every run; else only before the first and after the last.
    plain_between: bool = True
    # Repeats of a measurement that other processes disturbed.
    retries: int = RETRIES


FULL = Settings("full", noop_steps=2000, noop_repeats=3, sft_steps=100, sft_repeats=3)
QUICK = Settings("quick", 200, 1, sft_steps=10, sft_repeats=1, plain_between=False, retries=0)


@dataclass
class NoopRow:
    backend: str
    compute: str
    steps: int
    us_per_step: float  # median over the repeats of the mean step time
    samples_us: list[float]


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
class ComparisonRow:
    backend: str
    compute: str
    before_us: float  # no-op µs/step of the other checkout (median over repeats)
    now_us: float  # the same for this checkout, measured alongside
    ratio: float  # now / before


@dataclass
class SFTResult:
    rows: list[SFTRow]
    noise_pct: float
    plain_samples_ms: list[float]


def header(settings: Settings, in_process: bool) -> dict[str, Any]:
    return {
        "mode": settings.mode,
        "sft_isolation": "in-process" if in_process else "a fresh process per measurement",
        "torch": str(torch.__version__),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "anyio": version("anyio"),
        "trio": version("trio"),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def print_report(
    head: dict[str, Any], noop: list[NoopRow], sft: SFTResult, settings: Settings
) -> None:
    print(
        f"corun overhead ({head['mode']}): torch {head['torch']}, "
        f"torch threads {head['torch_threads']}, python {head['python']}, "
        f"anyio {head['anyio']}, trio {head['trio']}, {head['cpus']} CPUs, "
        f"load {head['load_avg_1m']} at start"
    )
    print(
        "per step = (t of last `step` event - t of first) / (steps - 1), from events.jsonl; "
        "set-up, step 1, the final save and teardown excluded"
    )
    print()
    print(
        f"1. runtime cost per step, no-op trainer "
        f"({settings.noop_steps} steps, median of {settings.noop_repeats})"
    )
    print(f"   {'backend':8} {'compute':8} {'µs/step':>9}   samples")
    for n in noop:
        samples = ", ".join(f"{x:.1f}" for x in n.samples_us)
        print(f"   {n.backend:8} {n.compute:8} {n.us_per_step:9.1f}   [{samples}]")
    print()
    print(
        f"2. SFT step (sort, d_model 128, batch {SFT_BATCH}, no eval; {settings.sft_steps} steps; "
        f"median of {settings.sft_repeats}; plain/run interleaved; {head['sft_isolation']})"
    )
    print(
        f"   {'backend':8} {'compute':8} {'plain ms':>9} {'run ms':>9} {'overhead':>9} "
        f"{'median-step':>12} {'template':>9}   target < {TARGET_PCT:g} %"
    )
    for s in sft.rows:
        verdict = "met" if s.target_met else "NOT met"
        print(
            f"   {s.backend:8} {s.compute:8} {s.plain_ms:9.2f} {s.run_ms:9.2f} "
            f"{s.overhead_pct:+8.2f}% {s.median_step_overhead_pct:+11.2f}% "
            f"{s.template_pct:8.2f}%   {verdict}"
        )
    print(
        "   template = the no-op run's cost per step (table 1) over the plain SFT step: what\n"
        "   the template itself adds, free of the step-to-step noise below; the verdict uses it"
    )
    print(
        f"   noise: a plain measurement is {sft.noise_pct:.2f} % off the plain median "
        f"(median over {len(sft.plain_samples_ms)})"
    )
    print()
    others = head["other_processes_cpus"]
    if others is None:
        print("other processes: not watched (no /proc/stat)")
        return
    quiet = head["disturbed"] == 0
    print(
        f"other processes kept {others:.2f} CPUs busy on average; of {head['measured']} "
        f"measurements {head['retried']} were repeated for being disturbed (> {BUSY_CPUS:g} "
        f"CPUs), {head['disturbed']} still were: "
        + ("quiet enough" if quiet else "figures unreliable, rerun on an idle machine")
    )


def print_comparison(rows: list[ComparisonRow], tree: Any, settings: Settings) -> None:
    print()
    print(
        f"3. runtime cost per step, no-op trainer: this checkout vs {tree} "
        f"({settings.noop_steps} steps, median of {settings.noop_repeats}, interleaved, "
        "each in a fresh process of its own checkout)"
    )
    print(f"   {'backend':8} {'compute':8} {'before µs':>10} {'now µs':>9} {'now/before':>11}")
    for r in rows:
        print(f"   {r.backend:8} {r.compute:8} {r.before_us:10.1f} {r.now_us:9.1f} {r.ratio:11.3f}")
