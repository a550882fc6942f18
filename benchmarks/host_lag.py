"""Event-loop lag a host service sees while corun trains inside it: the ``host_lag``
suite of ``corun bench``, and a program of its own::

    python -m benchmarks.host_lag                  # asyncio and trio: about a minute
    python -m benchmarks.host_lag --quick          # smoke mode: 20 steps
    python -m benchmarks.host_lag --inline         # + loop.compute = "inline" (blocks)
    python -m benchmarks.host_lag --explain        # where each wake-up > 5 ms late came from
    python -m benchmarks.host_lag --against TREE   # + another checkout, interleaved

A host task sleeps 1 ms in a loop and records how late each wake-up is: idle (3 s),
then while ``corun.run`` trains the ``sft`` recipe (300 steps, eval and a save every
100) in the host's task group (``training``: set-up and teardown included). Printed:
p50 / p99 / max lag, wake-ups later than 5 and 20 ms, steps per second and the median
step. Each measurement runs in a fresh interpreter: the GIL switch interval and the
garbage collector are process-wide.

``--explain`` takes each late wake-up apart, without a profiler or guessing: the ticker
reads its thread's ``/proc/.../schedstat`` around each sleep, which splits the lag into
time *queued* for a CPU (the OS ran other threads), time the loop thread *ran* (the
loop's own work) and the rest, *blocked*: waiting for the GIL while another thread held
it. On a late wake-up it records the other threads' Python stacks: the loop thread has
just got the GIL back, so they show where its holder had got to. ``gc.callbacks`` time
every collection and name its thread, and the run's ``trace.json`` spans (setup,
rollout, train, eval, snapshot, write) are matched to each late wake-up. It costs
~20 µs per tick.

Other processes' load ruins these figures (the loop thread then waits for a CPU): a
measurement they disturbed (over ``BUSY_CPUS``) is repeated.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path
from types import FrameType
from typing import Any

import anyio

from benchmarks.quiet import BUSY_CPUS, RETRY_PAUSE_S, OtherLoad, Request, in_fresh_interpreter
from benchmarks.report import Note, Table, fmt
from corun.contract.config_file import load_config
from corun.contract.registry import resolve_trainer
from corun.loop.teardown import RunControl
from corun.loop.template import run
from corun.records.events import EVENTS_FILE, TRACE_FILE, read_records

INSTALLED = str(Path(__file__).resolve().parents[2])  # the folder corun/ lies in
CONFIG = "sft"  # the recipe
TICK_S = 0.001
SPIKE_MS = 5.0
TARGET_P99_MS, TARGET_MAX_MS = 5.0, 20.0
GRIDS: dict[str, tuple[float, int, list[str]]] = {  # idle s, retries, overrides of sft
    "full": (3.0, 3, []),
    "quick": (0.5, 0, ["run.steps=20", "loop.eval_interval=10", "loop.save_interval=10"]),
    "tiny": (0.3, 0, ["run.steps=8", "loop.eval_interval=4", "loop.save_interval=4"]),
}
Row = tuple[str, str, str, dict[str, Any]]


# ----------------------------------------------------------------------------- in the host


class Ticker:
    """The host's own task: 1 ms sleeps, each wake-up's lateness recorded."""

    def __init__(self, explain: bool) -> None:
        self.explain = explain
        self.woken, self.lags = array("d"), array("d")  # perf_counter, s late
        self.queued, self.ran = array("d"), array("d")  # s off / on a CPU, per tick (explain)
        self.stacks: dict[int, list[tuple[str, list[str]]]] = {}  # other threads, late ticks
        self._sched = -1

    async def run(self) -> None:
        clock, sched = time.perf_counter, self._schedstat
        if self.explain:
            self._sched = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", 0)
        try:
            while True:
                before, slept = sched(), clock()
                await anyio.sleep(TICK_S)
                woken = clock()
                self.woken.append(woken)
                self.lags.append(lag := woken - slept - TICK_S)
                if self.explain:
                    ran, queued = sched()
                    self.ran.append(ran - before[0])
                    self.queued.append(queued - before[1])
                    if lag > SPIKE_MS * 1e-3:  # the GIL's last holder is still where it was
                        self.stacks[len(self.lags) - 1] = _other_stacks()
        finally:
            if self._sched >= 0:
                os.close(self._sched)

    def _schedstat(self) -> tuple[float, float]:
        """This thread's (CPU time, run-queue wait) so far, in seconds (Linux)."""
        if self._sched < 0:
            return (0.0, 0.0)
        ran, queued, _ = os.pread(self._sched, 96, 0).split()
        return (int(ran) * 1e-9, int(queued) * 1e-9)

    def span(self, start: int, end: int) -> dict[str, Any]:
        lags = sorted(self.lags[start:end])
        if not lags:
            return {"ticks": 0}

        def at(q: float) -> float:
            return lags[min(len(lags) - 1, int(q * len(lags)))] * 1e3

        return {
            "ticks": len(lags), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": lags[-1] * 1e3,
            "over_5ms": sum(x > 0.005 for x in lags), "over_20ms": sum(x > 0.020 for x in lags),
        }  # fmt: skip


def gc_timer(collections: list[tuple[float, float, int, str]]) -> Any:
    """A ``gc.callbacks`` entry appending (start, end, generation, thread) per collection."""
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            thread = threading.current_thread().name
            collections.append((started[0], time.perf_counter(), info["generation"], thread))

    return on_gc


def _other_stacks() -> list[tuple[str, list[str]]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return [(names.get(i, "?"), _stack(f)) for i, f in sys._current_frames().items() if i != me]


def _stack(frame: FrameType | None, depth: int = 60) -> list[str]:
    """Innermost first: ``path:line function`` with paths cut to the package."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        path = frame.f_code.co_filename
        for marker in ("site-packages/", "/lib/python3", INSTALLED + "/"):
            if marker in path:
                path = path.split(marker, 1)[1]
        out.append(f"{path}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return out


async def host(request: Request) -> dict[str, Any]:
    """The host service: tick idle, then tick while ``corun.run`` trains in its task group."""
    explain = request["explain"]
    ticker, collections = Ticker(explain), []  # type: ignore[var-annotated]
    on_gc = gc_timer(collections)
    if explain:
        gc.callbacks.append(on_gc)
    run_dir = Path(request["run_dir"])
    config = load_config(CONFIG, [
        f"run.dir={run_dir}", "log.progress=off", "log.wandb=disabled",
        f"loop.compute={request['compute']}", *request["overrides"],
    ])  # fmt: skip
    trainer = resolve_trainer(config.trainer.kind)(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        await anyio.sleep(request["idle_s"])
        idle_end = len(ticker.lags)
        started = time.perf_counter()
        outcome = await run(trainer, config, control=RunControl())
        ended = time.perf_counter()
        tg.cancel_scope.cancel()
    if explain:
        gc.callbacks.remove(on_gc)
    first = next(i for i in range(idle_end, len(ticker.woken)) if ticker.woken[i] > started)
    steps = [r["t"] for r in read_records(run_dir / EVENTS_FILE) if r["event"] == "step"]
    result: dict[str, Any] = {
        "outcome": outcome.reason,
        "idle": ticker.span(0, idle_end),
        "training": ticker.span(first, len(ticker.lags)),
        "run_s": ended - started,
        "steps_per_s": (len(steps) - 1) / (steps[-1] - steps[0]) if len(steps) > 1 else 0.0,
        "step_ms": statistics.median(b - a for a, b in pairwise(steps)) * 1e3 if steps else 0.0,
    }
    if explain:
        result["spikes"] = explain_spikes(ticker, collections, first, run_dir)
        result["tail"] = tail_parts(ticker, first, result["training"]["p99_ms"] * 1e-3)
    return result


# ----------------------------------------------------------------------------- --explain


def tail_parts(ticker: Ticker, first: int, p99: float) -> dict[str, float]:
    """What the late wake-ups at or past p99 are made of, in ms per wake-up."""
    tail = [i for i in range(first, len(ticker.lags)) if ticker.lags[i] >= p99]

    def mean(xs: Iterable[float]) -> float:
        return sum(xs) / max(len(tail), 1) * 1e3

    queued, ran = mean(ticker.queued[i] for i in tail), mean(ticker.ran[i] for i in tail)
    return {"lag_ms": (lag := mean(ticker.lags[i] for i in tail)), "queued_ms": queued,
            "ran_ms": ran, "blocked_ms": lag - queued - ran}  # fmt: skip


def explain_spikes(ticker: Ticker, collections: list[Any], first: int, run_dir: Path) -> list[Any]:
    """Each tick later than SPIKE_MS: its decomposition, overlapping spans, gc, stacks."""
    offset = time.time() - time.perf_counter()  # trace.json `ts` is time.time() in µs
    spans = [
        (s["ts"] * 1e-6 - offset, (s["ts"] + s["dur"]) * 1e-6 - offset, s["name"])
        for s in json.loads((run_dir / TRACE_FILE).read_text())
        if s.get("ph") == "X"
    ]
    spikes = []
    for i, stacks in ticker.stacks.items():  # the ticks later than SPIKE_MS
        if i < first:
            continue  # idle
        lag, end = ticker.lags[i], ticker.woken[i]
        start = end - lag
        gcs = [(b - a, g, t) for a, b, g, t in collections if a < end and b > start]
        overlapping = [(a, n) for a, b, n in spans if a < end and b > start]
        spikes.append({
            "at_s": end - ticker.woken[first], "lag_ms": lag * 1e3,
            "queued_ms": ticker.queued[i] * 1e3, "ran_ms": ticker.ran[i] * 1e3,
            "span": max(overlapping)[1] if overlapping else "-",  # the innermost
            "gc": [f"gen {g} {d * 1e3:.0f} ms in {t}" for d, g, t in gcs],
            "cause": _cause(lag, ticker.queued[i], ticker.ran[i], gcs),
            "holders": [_where(s) for t, s in stacks if t != "MainThread" and not _idle(s)],
        })  # fmt: skip
    return spikes


def _cause(lag: float, queued: float, ran: float, gcs: list[Any]) -> str:
    """One label per spike: a collection that covers most of it, else its largest part."""
    if gcs and max(d for d, _, _ in gcs) > lag / 2:
        _, gen, thread = max(gcs)
        return f"gc gen {gen} in {'the loop thread' if thread == 'MainThread' else thread}"
    blocked = max(lag - queued - ran, 0.0)
    parts = [(queued, "queued for a CPU"), (ran, "loop thread busy"), (blocked, "GIL wait")]
    return max(parts)[1]


# Where a parked thread's innermost frame is: a queue, an event, a sleep; trio's thread
# cache or a lane waiting (in C) for the next call.
_PARKED = ("threading.py", "queue.py", " wait", "selectors")
_PARKED_IN = (("_thread_cache.py", "_work"), ("corun/execution/compute.py", "_serve"))


def _idle(stack: list[str]) -> bool:
    """A thread parked in a queue, an event or a sleep holds nothing."""
    where, _, function = stack[0].rpartition(" ")
    path = where.rpartition(":")[0]
    return any(k in stack[0] for k in _PARKED) or any(
        path.endswith(file) and function == name for file, name in _PARKED_IN
    )


def _where(stack: list[str]) -> str:
    """The innermost frame, and the first corun/trainers frame above it for context."""
    ours = next((f for f in stack if f.startswith(("corun/", "trainers/"))), None)

    def short(frame: str) -> str:  # no line number
        return frame.split(":")[0] + " " + frame.split(" ", 1)[1]

    inner = short(stack[0]) if stack else "?"
    return inner if ours is None or ours == stack[0] else f"{inner} < {short(ours)}"


# ----------------------------------------------------------------------------- the parent


def in_fresh_process(request: Request) -> dict[str, Any]:
    """:func:`host` in a new interpreter (of ``request['tree']``'s checkout, if any),
    repeated (up to ``request['retries']`` times) while other processes disturb it."""
    for attempt in range(request["retries"] + 1):
        load = OtherLoad()  # a fresh dir each attempt: corun would resume
        run_dir = f"{request['run_dir']}-{attempt}"
        figures: dict[str, Any] = in_fresh_interpreter("host_lag", {**request, "run_dir": run_dir})
        figures |= {"others_cpus": (others := load.stop()), "attempts": attempt + 1}
        if others is None or others <= BUSY_CPUS or attempt == request["retries"]:
            return figures
        time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench host_lag``: how late a host task's 1 ms sleeps wake up, idle and
    while corun trains the ``sft`` recipe in its task group, asyncio and trio."""
    idle_s, _, overrides = GRIDS[grid]
    rows, ratios = [], []
    for backend in ("asyncio", "trio") if grid == "full" else ("asyncio",):
        note(f"{backend}: idle {idle_s:g} s, then training")
        r = in_fresh_process({"backend": backend, "compute": "thread", "idle_s": idle_s,
                              "retries": 0, "overrides": overrides, "explain": False,
                              "run_dir": str(scratch / f"host-lag-{backend}")})  # fmt: skip
        idle, training = r["idle"], r["training"]
        rows.append([backend, fmt(idle["p99_ms"]), fmt(training["p50_ms"]),
                     fmt(training["p99_ms"]), fmt(training["max_ms"], 1),
                     str(training["over_5ms"]), fmt(r["steps_per_s"], 1)])  # fmt: skip
        ratios.append((f"{backend} p99 training / idle", training["p99_ms"] / idle["p99_ms"]))
    return [Table(
        "host_lag", "lag", "Host loop lag (1 ms sleeps) while training the sft recipe",
        ["backend", "idle p99 ms", "training p50 ms", "training p99 ms", "training max ms",
         "> 5 ms", "steps/s"], rows, ratios,
        "the same host loop idle, just before the run (p99)",
    )]  # fmt: skip


def print_table(rows: list[Row]) -> None:
    print(f"{'tree':6} {'backend':8} {'compute':7} {'phase':9} {'ticks':>6} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'max ms':>7} {'>5ms':>5} {'>20ms':>5} {'steps/s':>8} {'step ms':>7} "
          f"{'others':>6}")  # fmt: skip
    for tree, backend, compute, r in rows:
        for phase in ("idle", "training"):
            s = r[phase]
            rate = f"{r['steps_per_s']:8.1f} {r['step_ms']:7.2f}" if phase == "training" else ""
            print(f"{tree:6} {backend:8} {compute:7} {phase:9} {s['ticks']:6} "
                  f"{s['p50_ms']:7.2f} {s['p99_ms']:7.2f} {s['max_ms']:7.1f} {s['over_5ms']:5} "
                  f"{s['over_20ms']:5} {rate:>16} {r['others_cpus'] or 0:6.2f}")  # fmt: skip


def print_spikes(tree: str, backend: str, compute: str, r: dict[str, Any]) -> None:
    spikes, t = r["spikes"], r["tail"]
    groups: dict[tuple[str, str], list[float]] = {}
    for s in spikes:
        groups.setdefault((s["cause"], s["span"]), []).append(s["lag_ms"])
    print(f"\n{tree} {backend}/{compute}: {len(spikes)} wake-ups later than {SPIKE_MS:g} ms")
    print(
        f"  the wake-ups at or past p99, on average: lag {t['lag_ms']:.2f} ms = queued "
        f"{t['queued_ms']:.2f} + ran {t['ran_ms']:.2f} + blocked {t['blocked_ms']:.2f}"
    )
    print(f"  {'count':>5} {'max ms':>7} {'sum ms':>7}  cause, during span")
    for (cause, span), lags in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(lags):5} {max(lags):7.1f} {sum(lags):7.0f}  {cause}, during {span}")
    holders = Counter(h for s in spikes if s["cause"] == "GIL wait" for h in s["holders"])
    if holders:
        print("  GIL wait: where the other threads were when the loop got the GIL back")
        for where, count in holders.most_common(10):
            print(f"  {count:5}  {where}")
    print("  the 6 latest: at s, lag = queued + ran + blocked ms, span, gc")
    for s in sorted(spikes, key=lambda s: -s["lag_ms"])[:6]:
        blocked = s["lag_ms"] - s["queued_ms"] - s["ran_ms"]
        gcs = "; ".join(g for g in s["gc"] if " 0 ms" not in g)
        print(
            f"  {s['at_s']:6.2f} {s['lag_ms']:6.1f} = {s['queued_ms']:5.1f} + "
            f"{s['ran_ms']:5.1f} + {blocked:6.1f}  {s['span']}  {gcs}"
        )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Host event-loop lag while corun trains.")
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke mode: 20 steps")
    add("--inline", action="store_true", help="also loop.compute=inline")
    add("--explain", action="store_true", help="attribute wake-ups > 5 ms late")
    add("--backend", choices=("asyncio", "trio"), action="append")
    add("--repeats", type=int, default=1, help="measure each this often")
    add("--set", metavar="KEY=VALUE", action="append", default=[],
        help="a config override for the trained run (repeatable)")  # fmt: skip
    add("--against", metavar="TREE", type=Path,
        help="also measure this checkout (e.g. a worktree of the commit before), "
        "interleaved with this one")  # fmt: skip
    add("--json", metavar="PATH", type=Path, help="also write the figures here")
    add("--measure", metavar="REQUEST", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.measure:  # a child of in_fresh_process: one measurement, one JSON line
        request = json.loads(args.measure)
        print(json.dumps(anyio.run(host, request, backend=request["backend"])))
        return 0
    idle_s, retries, overrides = GRIDS["quick" if args.quick else "full"]
    overrides = [*overrides, *args.set]
    trees = {"this": None} | ({"other": str(args.against.resolve())} if args.against else {})
    variants = [
        (tree, backend, compute)
        for backend in args.backend or ["asyncio", "trio"]
        for compute in (["thread", "inline"] if args.inline else ["thread"])
        for tree in trees
    ]
    print(
        f"host lag while training {CONFIG} ({'quick' if args.quick else 'full'}; overrides "
        f"{overrides or 'none'}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at "
        "start); trees: " + ", ".join(f"{t} = {path or INSTALLED}" for t, path in trees.items())
    )
    others = OtherLoad()
    rows = measure_all(args, variants, trees, (idle_s, retries, overrides))
    report(rows, others.stop(), args.json, trees)
    return 0


def measure_all(
    args: argparse.Namespace, variants: list[tuple[str, str, str]],
    trees: dict[str, str | None], grid: tuple[float, int, list[str]],
) -> list[Row]:  # fmt: skip
    """Each variant measured in a fresh process, ``args.repeats`` times, in an order
    that alternates so no variant holds a fixed slot."""
    idle_s, retries, overrides = grid
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="corun-host-lag-") as scratch:
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]
            for n, (tree, backend, compute) in enumerate(order):
                request = {
                    "backend": backend, "compute": compute, "idle_s": idle_s,
                    "retries": retries, "overrides": overrides, "explain": args.explain,
                    "run_dir": str(Path(scratch) / f"{repeat}-{n}"),
                } | ({"tree": trees[tree]} if trees[tree] else {})  # fmt: skip
                rows.append((tree, backend, compute, in_fresh_process(request)))
    rows.sort(key=lambda row: variants.index(row[:3]))
    return rows


def report(
    rows: list[Row], busy: float | None, json_path: Path | None, trees: dict[str, str | None]
) -> None:
    print_table(rows)
    for tree, backend, compute, r in rows:
        if "spikes" in r:
            print_spikes(tree, backend, compute, r)
    repeated = sum(r["attempts"] - 1 for *_, r in rows)
    disturbed = sum((r["others_cpus"] or 0) > BUSY_CPUS for *_, r in rows)
    print(
        f"\ntarget while training (thread compute): p99 <= {TARGET_P99_MS:g} ms, max <= "
        f"{TARGET_MAX_MS:g} ms; inline compute runs on the loop and blocks it by design.\n"
        f"other processes kept {busy or 0:.2f} CPUs busy on average; {repeated} measurement(s) "
        f"repeated for being disturbed (> {BUSY_CPUS:g} CPUs), {disturbed} still were"
        + (": figures unreliable, rerun on an idle machine" if disturbed else "")
    )
    if json_path is not None:
        figures = [{"tree": trees[t] or INSTALLED, "backend": b, "compute": c, **r}
                   for t, b, c, r in rows]  # fmt: skip
        json_path.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
