"""The interrupt storm: real ``corun train`` subprocesses, each sent SIGINT or SIGTERM
at a random moment (from 0 s: imports, set-up, training, eval, saves), across the
trainer families; then the contract is checked for every run.

Each run starts as a terminal's foreground job would: SIGINT and SIGTERM at their
default disposition (a ``cmd &`` from a script would start with SIGINT ignored) and a
process group of its own. Its checks:

- exit status 130 after SIGINT, 143 after SIGTERM (before corun's handlers are
  installed, killed by the signal counts: a shell shows the same status);
- once the run has started (a ``start`` event): ``end`` (reason ``interrupted``) last in
  events.jsonl after the teardown steps, each once, in the documented order, none
  failed; no partial checkpoint directory; every checkpoint loads, and the save on
  interrupt wrote the last completed step (the last completed window) if one was due;
- interrupted during imports or set-up: at most one line on stderr after the signal
  (not counting lines an uninterrupted run prints too: a library's start-up output),
  and never a traceback;
- a signal that comes after the run's outcome (in the teardown of a run that had
  finished its steps, or in interpreter exit): exit 0 and ``end`` reason ``done`` do;
- no process of its group, of the sessions its children opened, or any descendant seen
  while it ran, is left (from /proc);
- ``checkpoint.resume=true`` then finishes the step budget, restoring the newest
  checkpoint, with final weights and state bitwise equal to an uninterrupted run of the
  same config (computed once per config): sync mode, or the fixed version schedule.

A run is named by its seed: the seed picks the signal, the backend and the moment (a
phase of the reference run — imports, set-up, training — and a point in it); the case
is ``cases[seed % len(cases)]``. ``python -m tests.support.storm --runs 200`` runs the full
storm and prints the summary; ``--cases grpo --seeds 17`` repeats one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import events
from tests.support.storm_checks import (
    Case,
    Reference,
    Result,
    check_interrupted,
    check_resume,
    reference,
)
from tests.support.storm_procs import Child

PHASES = ("imports", "setup", "train", "train")  # half the signals while it trains
EXIT_S = 90.0  # the process must exit this long after the signal (hard deadline: 60 s)

# ----------------------------------------------------------------------------- cases

# The shipped configs with tiny models, no warm start (init_from: trained first), 60
# steps: a few seconds a run (tests/support/storm_checks.py adds the cadence: see _COMMON).
_LM = "trainer.d_model=32 trainer.n_heads=2 trainer.n_layers=1"
_RL = f"trainer.init_from= {_LM} trainer.samples_per_prompt=4 trainer.eval_size=8"
_FIXED = "loop.version_schedule=fixed"  # async runs: reproducible, resume exact
_AGENTIC = (
    f"trainer.init_from= {_LM} trainer.samples_per_prompt=4 trainer.eval_size=16 "
    "trainer.env.latency_ms=5 data.batch_size=2"
)
_FLOW = (
    "trainer.init_from= trainer.d_model=32 trainer.n_layers=1 trainer.n_heads=2 "
    "trainer.sample_steps=4 trainer.eval_size=8 trainer.grid_size=0 "
    "trainer.grpo.samples_per_prompt=4 data.batch_size=2"
)
_VLLM = (  # the built-in tiny Llama (the config's model), vLLM in process
    "trainer.init_from= trainer.samples_per_prompt=4 trainer.max_new_tokens=6 "
    "trainer.eval_size=8 data.batch_size=2 loop.eval_interval=4"
)
CASES = {
    case.name: case
    for case in (
        Case("sft", "sft.toml", f"{_LM} trainer.eval_size=16 data.batch_size=8", ci=False),
        Case("grpo", "grpo.toml", f"{_RL} data.batch_size=4"),
        Case("grpo_async", "grpo_async.toml", f"{_RL} data.batch_size=4 {_FIXED}"),
        Case("flow_grpo", "flow_grpo.toml", _FLOW, accumulate=2, ci=False),
        Case("agentic", "agentic.toml", _AGENTIC, ci=False),
        Case("agentic_async", "agentic_async.toml", f"{_AGENTIC} {_FIXED}"),
        # ~25 s a run on 2 cores, most of it vLLM's start
        Case("hf_grpo_vllm", "hf_grpo_vllm.toml", _VLLM, steps=16, ci=False, timeout_s=300.0),
    )
}


def _landed(child: Child, run_dir: Path) -> str:
    if child.proc.poll() is not None:
        return "after-exit"
    names = {r["event"] for r in events(run_dir)}
    order = (
        ("end", "after-end"),
        ("teardown:stop", "teardown"),
        ("setup", "train"),
        ("start", "setup"),
    )
    for name, where in order:
        if name in names:
            return where
    return "imports"


def storm_run(case: Case, ref: Reference, seed: int, work: Path, keep: bool = False) -> Result:
    rng = random.Random(seed)
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    backend = rng.choice(["asyncio", "trio"])
    aimed = rng.choice(PHASES)
    low, high = ref.window(aimed)
    # Into the phase, timed from its first event; training a little short of the
    # reference's, so that fewer signals come after the end on a slower run.
    wait = rng.random() * (high - low) * (0.8 if aimed == "train" else 1.0)
    result = Result(seed, case.name, sig.name, backend, aimed, 0.0)
    out = work / f"run-{seed}"
    run_dir = out / "run"
    child = Child.start(case.command(run_dir, f"run.backend={backend}"), out)
    try:
        anchor = {"imports": None, "setup": "start", "train": "setup"}[aimed]
        if anchor is not None:  # the phase begins with this event (on a slow machine, later)
            child.sleep_until(lambda: anchor in {r["event"] for r in events(run_dir)}, EXIT_S)
        child.sleep(wait)
        result.landed = _landed(child, run_dir)
        result.stepped = max(
            (r["step"] for r in events(run_dir) if r["event"] == "step"), default=0
        )
        said = child.stderr_size()
        signalled = time.monotonic()
        result.delay_s = time.time() - child.launched
        if child.proc.poll() is None:
            child.proc.send_signal(sig)
        result.code = child.wait(EXIT_S)
        if result.code is None:
            result.failures.append(f"still running {EXIT_S:.0f} s after the signal")
            return result
        result.teardown_s = time.monotonic() - signalled
        result.failures += check_interrupted(case, ref, result, sig, child, run_dir, said)
    finally:
        child.close()
    # No run directory: nothing was written, and a resume would be the reference run.
    if run_dir.exists():
        result.failures += check_resume(case, ref, result, run_dir, out)
    if result.ok and not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- the storm


@dataclass
class Storm:
    results: list[Result]
    cases: list[str]
    seconds: float

    def summary(self) -> str:
        results = self.results
        ok = [r for r in results if r.ok]
        lines = [
            f"interrupt storm: {len(results)} runs, {len(ok)} passed, "
            f"{len(results) - len(ok)} failed, {self.seconds:.0f} s"
        ]
        landed = Counter(r.landed for r in results)
        lines.append("landed: " + ", ".join(f"{k} {landed[k]}" for k in sorted(landed)))
        signals = Counter(r.signal for r in results)
        backends = Counter(r.backend for r in results)
        lines.append(
            "signals: "
            + ", ".join(f"{k} {v}" for k, v in sorted(signals.items()))
            + "; backends: "
            + ", ".join(f"{k} {v}" for k, v in sorted(backends.items()))
        )
        lines.append(f"{'config':<14} {'runs':>5} {'passed':>7} {'resumed from a checkpoint':>26}")
        for name in self.cases:
            mine = [r for r in results if r.case == name]
            restored = sum(1 for r in mine if r.restored)
            lines.append(f"{name:<14} {len(mine):>5} {sum(r.ok for r in mine):>7} {restored:>26}")
        timed = [r for r in results if r.teardown_s is not None and r.landed != "after-exit"]
        if timed:
            slow = max(timed, key=lambda r: r.teardown_s or 0.0)
            median = sorted(r.teardown_s or 0.0 for r in timed)[len(timed) // 2]
            lines.append(
                f"signal to exit: median {median:.2f} s, slowest {slow.teardown_s:.2f} s "
                f"(seed {slow.seed}, {slow.case}, {slow.signal} in {slow.landed})"
            )
        failed = [r for r in results if not r.ok]
        if failed:
            lines.append("failures:")
            lines += ["  " + r.line() for r in failed]
        return "\n".join(lines)


def storm(
    seeds: Iterable[int],
    cases: list[str],
    work: Path,
    *,
    workers: int = 1,
    keep: bool = False,
    report: Callable[[Result], None] = lambda r: None,
) -> Storm:
    """Run the storm: the reference runs first, then one storm run per seed, on
    ``workers`` processes (spawned, so each starts its subprocesses single-threaded)."""
    started = time.monotonic()
    seeds = list(seeds)
    picked = {seed: cases[seed % len(cases)] for seed in seeds}
    used = [name for name in cases if name in picked.values()]
    results = []
    if workers <= 1:
        refs = {name: reference(CASES[name], work) for name in used}
        for seed, name in picked.items():
            results.append(storm_run(CASES[name], refs[name], seed, work, keep))
            report(results[-1])
    else:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
            found = pool.map(reference, [CASES[name] for name in used], [work] * len(used))
            refs = dict(zip(used, found, strict=True))
            runs = [
                pool.submit(storm_run, CASES[name], refs[name], seed, work, keep)
                for seed, name in picked.items()
            ]
            for done in as_completed(runs):
                results.append(done.result())
                report(results[-1])
    results.sort(key=lambda r: r.seed)
    return Storm(results, used, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.storm", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--runs", type=int, default=200, help="storm runs (seeds SEED, SEED+1, ...)")
    add("--seed", type=int, default=0, help="the first seed")
    add("--seeds", default="", help="comma-separated seeds to run instead")
    add("--cases", default=",".join(CASES), help="configs, comma-separated (default: all)")
    add("--ci", action="store_true", help="only the CI-sized storm's configs (no vLLM)")
    add("--workers", type=int, default=2, help="runs at a time (default 2)")
    add("--work", default="", help="where run directories go (default: a temporary one)")
    add("--keep", action="store_true", help="keep the directories of passed runs too")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c and (not args.ci or CASES[c].ci)]
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = list(range(args.seed, args.seed + args.runs))
    work = Path(args.work or tempfile.mkdtemp(prefix="corun-storm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"storm: {len(seeds)} runs over {', '.join(cases)}; run directories in {work}", flush=True
    )
    result = storm(
        seeds,
        cases,
        work,
        workers=args.workers,
        keep=args.keep,
        report=lambda r: print(r.line(), flush=True),
    )
    print(result.summary())
    passed = all(r.ok for r in result.results)
    if passed and not args.work and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    from tests.support.storm import main as storm_main  # one module identity for the workers

    sys.exit(storm_main())
