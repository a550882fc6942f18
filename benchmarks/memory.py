"""``corun bench memory``: the ``hf_grpo`` update's peak memory, before and after.

Against rows per step, response length and vocabulary. "Before" is the update as it
was: a mini-batch's rows all at once, the whole (rows x length x vocabulary) logits
held several times (``loop.micro_batch_tokens=0 trainer.logits_chunk=0``); "after" is
the defaults (token-budget micro-batches of ``loop.micro_batch_tokens``, log-probs in
chunks of ``trainer.logits_chunk`` logits). The model is the built-in tiny Llama with
its embeddings and output head resized to the vocabulary (at Qwen's 151,936 rows:
~20M parameters, nearly all of them those two).

Each point is a fresh process (``python -m benchmarks.memory_job``): a real
``hf_grpo`` trainer set up as the runtime does it, 2 updates of a fabricated batch
(R/8 prompts x 8 samples, prompts of 22 tokens, T full-length responses, every row an
advantage) through the runtime's update protocol; its figure is the process's peak RSS
as ``wait4`` reports it to this one (set-up included: the "set-up MiB" column is the
job's own peak before its first update). Tables: against rows per step (T=64,
V=151,936), response length (R=128) and vocabulary (R=128, T=64), after/before; the
after-peak's growth with rows at the fixed token budget (target: at most 1.2x from 64
to 1024 rows); and ``corun train hf_grpo`` end to end, generation included, at
V=151,936 with 16 and 64 new tokens (target: at most 4 GiB after at 64).

Memory is guarded, for the machine runs other work: a "before" point whose logits
alone (rows x T x V x 4 bytes, ~5 copies) are estimated past 16 GiB, or past what the
machine has free, is not run ("skipped: ~N GiB estimated"), and a process whose
resident size (its children's included) passes that limit is stopped ("stopped") and
the larger points of its setting on that axis skipped.

::

    python -m benchmarks.memory           # the full grid: about an hour on 2 cores
    python -m benchmarks.memory --quick   # V=16,384 at 128 rows: the update before and after
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Note, Table, fmt
from benchmarks.suite import main_of

QWEN_VOCAB = 151_936
GIB = 1 << 30
LIMIT = 16 * GIB  # the most one point may hold, whatever is free
MARGIN = 2 * GIB  # left free for the rest of the machine
COPIES = 5  # the logits, scaled, log-softmax, its exp and their product: held at once
ENV = {**os.environ, "WANDB_MODE": "disabled"}
BEFORE = "before (loop.micro_batch_tokens=0, trainer.logits_chunk=0)"


@dataclass(frozen=True)
class Grid:
    vocab: int  # V of the rows and length axes and of the end-to-end runs
    length: int  # T of the rows and vocabulary axes
    rows_at: int  # R of the length and vocabulary axes and of the end-to-end runs
    rows: tuple[int, ...]  # rows per step: multiples of 8 (prompts x 8 samples)
    lengths: tuple[int, ...] = ()
    vocabs: tuple[int, ...] = ()
    end_to_end: tuple[int, ...] = ()  # new tokens of each corun train run
    # loop.micro_batch_tokens of the growth table: one the fewest rows already fill
    growth_budget: int = 4096
    peers: bool = False  # the ~50M peers job against TRL (benchmarks/peers.py)


FULL = Grid(
    QWEN_VOCAB, 64, 128, rows=(64, 128, 256, 512, 1024), lengths=(16, 32, 64, 128, 256, 512),
    vocabs=(400, 4096, 32768, QWEN_VOCAB), end_to_end=(16, 64), peers=True,
)  # fmt: skip
GRIDS = {
    "full": FULL,
    # 16,384 rows: 128 x 16 response tokens are then over the default logits_chunk (a
    # split to see); at 4,096 nothing would be.
    "quick": Grid(16_384, 16, 128, (128,), growth_budget=2048),
    "tiny": Grid(512, 8, 16, (16, 32), end_to_end=(8,), growth_budget=256),
}


@dataclass(frozen=True)
class Point:
    rows: int
    tokens: int  # response tokens per row
    vocab: int
    before: bool
    end_to_end: bool = False
    budget: int | None = None  # loop.micro_batch_tokens; None: the default

    def estimate(self) -> int:
        """Bytes the unsplit update's logits hold: the skip rule's estimate."""
        return self.rows * self.tokens * self.vocab * 4 * COPIES


@dataclass(frozen=True)
class Measured:
    rss_mib: float  # wait4's peak of the point's process (and its children)
    update_s: float  # the last update (the first allocates the optimizer's state)
    setup_mib: float | None  # the job's own peak before its first update


Cell = Measured | str  # a figure, or why there is none


# ----------------------------------------------------------------------------- processes


def free_bytes() -> int:
    """The machine's available memory (``MemAvailable``)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return LIMIT + MARGIN


def limit_bytes() -> int:
    """What a point may hold now: 16 GiB, or less when less is free."""
    return min(LIMIT, free_bytes() - MARGIN)


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (a process gone counts 0)."""
    total, pending = 0, [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            status = (proc / "status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines()
                          if line.startswith("VmRSS:"))  # fmt: skip
            for task in (proc / "task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):  # exited meanwhile, or a zombie
            continue
    return total


@dataclass
class Finished:
    stdout: str
    stderr: str
    peak_mib: float  # wait4's ru_maxrss: the process's and its waited-for children's
    returncode: int
    stopped: bool = False  # killed at the limit


def run_guarded(command: list[str], limit: int, logs: Path) -> Finished:
    """Run ``command`` (its own process group), stopping it when its tree's resident size
    passes ``limit``; its output and ``wait4``'s peak RSS. Output goes to files: the
    process is reaped by ``wait4`` alone, which a pipe's reader would have to share."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=ENV,
                                start_new_session=True)  # fmt: skip
    stopped = False
    try:
        # WNOWAIT: see it exit without reaping it, so that wait4 still has its usage.
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if not stopped and tree_rss(proc.pid) > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                stopped = True
            time.sleep(0.05)
    except BaseException:  # Ctrl-C: its own session does not get the terminal's SIGINT
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Finished(out.read_text(), err.read_text(), usage.ru_maxrss / 1024, proc.returncode,
                    stopped)  # fmt: skip


def job(*args: str) -> dict[str, Any]:
    """``python -m benchmarks.memory_job ARGS``'s JSON line (unmeasured)."""
    command = [sys.executable, "-m", "benchmarks.memory_job", *args]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory_job {args[0]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ----------------------------------------------------------------------------- points


@dataclass
class Runner:
    """Each point measured once (the axes share some), its model built once per vocabulary."""

    scratch: Path
    note: Note
    cells: dict[Point, Cell] = field(default_factory=dict)
    models: dict[int, Path] = field(default_factory=dict)

    def model(self, vocab: int) -> Path:
        if vocab not in self.models:
            self.note(f"building the tiny Llama at vocabulary {vocab:,}")
            got = job("build", str(vocab), str(self.scratch / f"tiny-llama-v{vocab}"))
            self.models[vocab] = Path(got["dir"])
        return self.models[vocab]

    def cell(self, point: Point) -> Cell:
        if point not in self.cells:
            self.cells[point] = self.measure(point)
        return self.cells[point]

    def measure(self, point: Point) -> Cell:
        limit = limit_bytes()
        if point.before and point.estimate() > limit:
            short = "" if limit == LIMIT else f", {limit / GIB:.1f} GiB to spare"
            return f"skipped: ~{point.estimate() / GIB:.0f} GiB estimated{short}"
        name = (f"{'e2e' if point.end_to_end else 'update'}-r{point.rows}-t{point.tokens}-"
                f"v{point.vocab}-{'before' if point.before else 'after'}"
                f"{'' if point.budget is None else f'-b{point.budget}'}")  # fmt: skip
        model = self.model(point.vocab)
        self.note(name.replace("-", " "))
        args = [str(model), str(point.rows), str(point.tokens)]
        args += ["--end-to-end", str(self.scratch / name)] if point.end_to_end else []
        args += ["--before"] if point.before else []
        args += [] if point.budget is None else ["--budget", str(point.budget)]
        command = [sys.executable, "-m", "benchmarks.memory_job", "update", *args]
        done = run_guarded(command, limit, self.scratch / name)
        if done.stopped:
            return f"stopped: passed {limit / GIB:.1f} GiB"
        if done.returncode != 0:
            raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        return Measured(done.peak_mib, got["update_s"][-1], got.get("setup_rss_mib"))

    def axis(self, points: Sequence[Point]) -> list[Cell]:
        """``points`` in order of size; past a point stopped at the limit, the larger ones
        of its setting are not run."""
        cells: list[Cell] = []
        passed: str | None = None
        for point in points:
            cell = f"skipped: {passed}" if passed else self.cell(point)
            if isinstance(cell, str) and cell.startswith("stopped"):
                passed = f"a smaller point {cell.removeprefix('stopped: ')}"
            cells.append(cell)
        return cells


# ----------------------------------------------------------------------------- tables


def mib(cell: Cell) -> str:
    return fmt(cell.rss_mib, 0) if isinstance(cell, Measured) else cell


def seconds(cell: Cell) -> str:
    return fmt(cell.update_s, 2) if isinstance(cell, Measured) else "-"


def ratio(after: Cell, before: Cell) -> float | None:
    if isinstance(after, Measured) and isinstance(before, Measured):
        return after.rss_mib / before.rss_mib
    return None


def comparison(
    runner: Runner, name: str, title: str, label: str, values: Sequence[int],
    point: Callable[[int, bool], Point], notes: list[str],
) -> Table:  # fmt: skip
    """Before against after at each of ``values`` (``point(value, before)``), with the
    set-up's own peak where the job reports it (not end to end)."""
    befores = runner.axis([point(value, True) for value in values])
    afters = runner.axis([point(value, False) for value in values])
    with_setup = not point(values[0], False).end_to_end
    rows, ratios = [], []
    for value, before, after in zip(values, befores, afters, strict=True):
        got = ratio(after, before)
        cells = [mib(before), mib(after), "-" if got is None else fmt(got, 2), seconds(before),
                 seconds(after)]  # fmt: skip
        rows.append([f"{value:,}", *([setup_mib(after, before)] if with_setup else []), *cells])
        if got is not None:
            ratios.append((f"{label} {value:,}", got))
    columns = [label, *(["set-up MiB"] if with_setup else []), "before MiB", "after MiB",
               "after / before", "before s/update", "after s/update"]  # fmt: skip
    return Table("memory", name, title, columns, rows, ratios, f"{BEFORE}, same point", notes)


def setup_mib(*cells: Cell) -> str:
    """The job's peak before its first update, from the first cell measured."""
    found = [c.setup_mib for c in cells if isinstance(c, Measured) and c.setup_mib is not None]
    return fmt(found[0], 0) if found else "-"


def growth(runner: Runner, grid: Grid) -> Table:
    """The after-peak against rows per step at a fixed token budget that the fewest rows
    already fill, and at the default budget, each over its fewest rows' (cells measured)."""
    budget = grid.growth_budget
    fixed = runner.axis([Point(r, grid.length, grid.vocab, False, budget=budget)
                         for r in grid.rows])  # fmt: skip
    default = runner.axis([Point(r, grid.length, grid.vocab, False) for r in grid.rows])
    rows, ratios = [], []
    for count, cell, at_default in zip(grid.rows, fixed, default, strict=True):
        got, got_default = ratio(cell, fixed[0]), ratio(at_default, default[0])
        rows.append(
            [
                f"{count:,}",
                mib(cell),
                "-" if got is None else fmt(got, 2),
                mib(at_default),
                "-" if got_default is None else fmt(got_default, 2),
            ]
        )
        if got is not None:
            ratios.append((f"{count:,} rows", got))
    most, least = grid.rows[-1], grid.rows[0]
    return Table(
        "memory", "growth", f"The after-peak against rows per step at a fixed token budget "
        f"(T={grid.length}, V={grid.vocab:,})", ["rows per step",
        f"MiB at {budget:,} tokens", f"vs {least} rows", "MiB at the default budget",
        f"vs {least} rows (default)"], rows, ratios,
        f"the peak at {least} rows, budget {budget:,}",
        [f"Target: at most 1.2x from 64 to 1,024 rows at a fixed budget (the full grid; here "
         f"{least} to {most:,}). At {budget:,} tokens every step is split, so one backward "
         "pass holds the same whatever the rows; at the default (32,768) the fewer rows "
         "fit whole and the peak grows until a step fills the budget, then stays flat. "
         "The batch's own tensors grow with its rows either way."],
    )  # fmt: skip


# The ~50M peers job's settings of corun against TRL's (benchmarks/peers.py).
PEER_RUNS = {
    "corun hf_grpo (defaults)": (),
    "corun, loop.micro_batch_tokens=1024": ("loop.micro_batch_tokens=1024",),
    "corun, trainer.activation_checkpointing=true": ("trainer.activation_checkpointing=true",),
}
PEER_STEPS = 6


def peers_table(runner: Runner) -> Table:
    """corun's peak RSS on the ~50M peers job (defaults, a budget, checkpointing) against
    TRL's GRPOTrainer with passive waiting, each a fresh process."""
    from benchmarks import peers

    model, millions = peers.big_model(runner.scratch)
    missing = peers.trl_missing()
    trl = None
    if missing is None:
        runner.note("TRL on the ~50M peers job")
        trl = peers.run_trl(model, PEER_STEPS, 0, runner.scratch / "peers-trl", passive=True)
    rows: list[list[str]] = []
    ratios: list[tuple[str, float]] = []
    for name, overrides in PEER_RUNS.items():
        runner.note(f"{name} on the ~50M peers job")
        out = runner.scratch / f"peers-{len(rows)}"
        got = peers.run_corun(model, PEER_STEPS, 0, out, overrides=overrides)
        share = None if trl is None else got["rss_mib"] / trl["rss_mib"]
        rows.append([name, fmt(got["rss_mib"], 0), "-" if share is None else fmt(share, 2),
                     fmt(got["step_s"], 2)])  # fmt: skip
        if share is not None:
            ratios.append((name.removeprefix("corun, "), share))
    if trl is not None:
        rows.append(["TRL, OMP_WAIT_POLICY=PASSIVE", fmt(trl["rss_mib"], 0), "1.00",
                     fmt(trl["step_s"], 2)])  # fmt: skip
    notes = [f"The ~{millions:g}M-parameter Llama of `corun bench peers` (16 prompts x 8 "
             f"samples, 8 new tokens), {PEER_STEPS} steps, no evaluation; peak RSS of each "
             "process (wait4). Target: corun at most TRL's, at the defaults or with the "
             "one documented budget setting."]  # fmt: skip
    if missing is not None:
        notes.append(missing)
    return Table(
        "memory", "peers", f"Peak RSS on the ~{millions:g}M peers job against TRL",
        ["runtime", "peak RSS MiB", "vs TRL", "s/step"], rows, ratios,
        "TRL's GRPOTrainer (passive) peak RSS", notes,
    )  # fmt: skip


def end_to_end(runner: Runner, grid: Grid) -> Table:
    """``corun train hf_grpo`` before and after at each new-token count."""

    def point(tokens: int, before: bool) -> Point:
        return Point(grid.rows_at, tokens, grid.vocab, before, end_to_end=True)

    notes = [f"`corun train hf_grpo` on the resized model, {grid.rows_at // 8} prompts x 8 "
             "samples, 2 steps, generation on the local engine included; peak RSS of the "
             "run's process (wait4); s/update: the last step's `perf/train_time_s`. Target: "
             "at most 4 GiB after at 64 new tokens (V=151,936). A 'before' point estimated "
             "past the limit is skipped, as in the tables above."]  # fmt: skip
    title = f"corun train hf_grpo end to end (R={grid.rows_at}, V={grid.vocab:,})"
    return comparison(runner, "end_to_end", title, "new tokens", grid.end_to_end, point, notes)


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    grid = GRIDS[grid_name]
    runner = Runner(scratch, note)
    rule = [f"Peak RSS of a fresh process per point (wait4), set-up included. A 'before' "
            f"point estimated past {LIMIT // GIB} GiB (rows x T x V x 4 bytes x {COPIES}) "
            "or past what is free is skipped; a process past that limit is stopped."]  # fmt: skip
    tables = [comparison(
        runner, "rows", f"The update's peak RSS against rows per step (T={grid.length}, "
        f"V={grid.vocab:,})", "rows", grid.rows,
        lambda r, before: Point(r, grid.length, grid.vocab, before), rule,
    )]  # fmt: skip
    if grid.lengths:
        tables.append(comparison(
            runner, "length", f"The update's peak RSS against response length (R="
            f"{grid.rows_at}, V={grid.vocab:,})", "response tokens", grid.lengths,
            lambda t, before: Point(grid.rows_at, t, grid.vocab, before), rule,
        ))  # fmt: skip
    if grid.vocabs:
        tables.append(comparison(
            runner, "vocab", f"The update's peak RSS against vocabulary (R={grid.rows_at}, "
            f"T={grid.length})", "vocabulary", grid.vocabs,
            lambda v, before: Point(grid.rows_at, grid.length, v, before), rule,
        ))  # fmt: skip
    if len(grid.rows) > 1:  # growth against the fewest rows: none with one row count
        tables.append(growth(runner, grid))
    if grid.end_to_end:
        tables.append(end_to_end(runner, grid))
    if grid.peers:
        tables.append(peers_table(runner))
    return tables


if __name__ == "__main__":
    sys.exit(main_of("memory", __doc__.splitlines()[0]))
