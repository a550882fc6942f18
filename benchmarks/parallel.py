"""What ``run.parallel`` buys on this machine: peak memory per rank and step time of
an HF model at 1 rank and at 2 ranks under ``"ddp"`` and ``"fsdp"``, and the weight
sync of full weights against a LoRA adapter's. Real ``corun train`` processes on a
Llama of trainers/hf/tiny.py's shape (random weights; the full grid's 53M parameters).
The ``parallel`` suite of ``corun bench``, and a program of its own::

    python -m benchmarks.parallel                # ~4-5 min on 2 quiet CPUs
    python -m benchmarks.parallel --quick        # a 7M-parameter model
    python -m benchmarks.parallel --grid tiny --json out.json   # the test's, ~1 min

1. **Memory and step time** (``hf_sft``, the same global batch in every run). A rank's
   peak memory is its resident set's high-water mark (``VmHWM``, /proc/<pid>/status),
   read every 50 ms while it trains, up to its last step: the final checkpoint's
   snapshot, which copies the state, comes after (its peak is the last column). A rank
   is a process under the ``corun train`` process with torchrun's ``LOCAL_RANK`` in
   its environment, or that process itself at 1 rank. Beside it, the model's share:
   parameters, gradients and AdamW's two moments, from the 1-rank run's checkpoint
   (its tensors' bytes), over the ranks under fsdp. Step time: the median
   ``perf/train_time_s`` after the first step (rank 0's records). Every layout runs
   twice (not in the tiny grid): under glibc's default malloc, and with a fixed mmap
   threshold, which lets the freed all-gather buffers of FSDP leave the resident set
   (see ``MALLOCS``).
2. **Weight sync** (``hf_grpo`` on the ``local`` engine, 1 rank): full weights against
   ``[trainer.lora]`` (rank 8 on the attention projections): the median
   ``perf/sync_time_s`` after the first sync, and the bytes a sync sends, which are
   the trained weights the run's checkpoint holds (all of them, or the adapter's). A
   sync's time includes its verification: a fingerprint of the whole state (base and
   adapter) on each side (corun/engines/fingerprint.py).

Nothing is asserted; ratios are against the 1-rank run and the full-weight sync of the
same bench run. Times want a quiet machine (the tables say how busy the rest of it was:
benchmarks/quiet.py); memory does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch

from benchmarks.quiet import BUSY_CPUS, OtherLoad
from benchmarks.report import Note, Table, fmt, markdown_table
from corun.records.checkpoint import TENSORS_FILE, latest
from corun.records.events import EVENTS_FILE, METRICS_FILE, read_records

MB = 1 << 20
POLL_S = 0.05  # how often each rank's memory is read
RUN_TIMEOUT_S = 900.0
LORA = {"rank": 8}  # the attention projections: LoraSettings' default targets
LAYOUTS = (("1 rank", 1, "ddp"), ("2 ranks, ddp", 2, "ddp"), ("2 ranks, fsdp", 2, "fsdp"))
# glibc's malloc by default raises its mmap threshold to the largest block freed, so
# FSDP's per-layer all-gather buffers, freed and allocated again every step, come from
# the heap after the first and its high-water mark stays (measured: an fsdp rank's peak
# above the 1-rank run's); a fixed threshold returns them to the system when freed.
MALLOCS = {"glibc default": {}, "mmap threshold 1 MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
# hf_grpo's syncs: (label, [trainer] additions, ranks, run.parallel). The sharded ones
# gather a sync in 64 MiB buckets (the default) or the whole model at once, which holds
# a second whole copy on the rank: their peak memory shows what streaming saves.
WHOLE = 1 << 40  # a bucket larger than any model: everything gathered before loading
SYNCS: tuple[tuple[str, dict[str, Any], int, str], ...] = (
    ("full weights", {}, 1, "ddp"),
    ("LoRA adapter", {"lora": LORA}, 1, "ddp"),
    ("full weights, 2 ranks fsdp, 64 MiB buckets", {}, 2, "fsdp"),
    ("full weights, 2 ranks fsdp, gathered whole", {"sync_bucket_bytes": WHOLE}, 2, "fsdp"),
)


@dataclass(frozen=True)
class Settings:
    name: str
    hidden: int  # the model's (trainers/hf/tiny.py); 0: the built-in tiny Llama
    layers: int
    steps: int  # hf_sft steps per run
    batch: int  # hf_sft prompts per step (global: a multiple of 2)
    syncs: int  # hf_grpo steps per run, a sync after each
    mallocs: tuple[str, ...]  # of MALLOCS: the hf_sft runs are made under each


GRIDS = {
    "full": Settings("full", 1024, 8, 5, 8, 4, tuple(MALLOCS)),  # 53M parameters
    "quick": Settings("quick", 512, 4, 4, 8, 3, tuple(MALLOCS)),  # 7M
    "tiny": Settings("tiny", 0, 0, 2, 4, 2, ("glibc default",)),  # the built-in tiny Llama
}


@dataclass
class Run:
    label: str
    malloc: str  # of MALLOCS
    nproc: int
    parallel: str
    peaks_mb: list[float]  # each rank's peak resident memory while training, by rank
    exit_peaks_mb: list[float]  # ... up to its exit (the final checkpoint's included)
    step_ms: float  # median perf/train_time_s after the first step
    collective_ms: float  # median perf/collective_time_s after the first step
    sync_ms: float  # median perf/sync_time_s after the first sync (hf_grpo)
    weight_bytes: int  # the trained weights in the final checkpoint (1 rank)
    optimizer_bytes: int  # the optimizer's state in it
    seconds: float  # the whole process, start to exit


# ----------------------------------------------------------------------------- ranks' memory


class RankMemory:
    """Each rank's resident-memory high-water mark under the process ``root``, sampled
    with the time (wall clock, as run events are) until ``root`` exits."""

    def __init__(self, root: int, nproc: int) -> None:
        self.root, self.nproc = root, nproc
        self.rank_of: dict[int, int] = {}  # pid: its rank
        self.samples: dict[int, list[tuple[float, int]]] = {}  # rank: (time, bytes)

    def follow(self, child: subprocess.Popen[bytes], timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while child.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"corun train ran past {timeout_s:.0f} s")
            self.sample()
            time.sleep(POLL_S)
        return child.returncode

    def sample(self) -> None:
        now = time.time()
        for pid, rank in self.ranks().items():
            peak = _peak_resident(pid)
            if peak is not None:
                self.samples.setdefault(rank, []).append((now, peak))

    def ranks(self) -> dict[int, int]:
        """pid: rank of every rank alive now (torchrun's workers carry LOCAL_RANK; a
        process that has not exec'd yet has its parent's environment: asked again)."""
        if self.nproc == 1:
            return {self.root: 0}
        for pid in _descendants(self.root):
            if pid not in self.rank_of and (rank := _local_rank(pid)) is not None:
                self.rank_of[pid] = rank
        return self.rank_of

    def peaks_mb(self, until: float | None = None) -> list[float]:
        """Each rank's peak, by rank: over the samples up to ``until`` (all if None)."""
        peaks = []
        for rank in sorted(self.samples):
            taken = [b for t, b in self.samples[rank] if until is None or t <= until]
            peaks.append(max(taken or [b for _, b in self.samples[rank]]) / MB)
        return peaks


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (one pass over /proc)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    parents[int(entry.name)] = int(stat.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _local_rank(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"LOCAL_RANK="):
            return int(entry.split(b"=", 1)[1])
    return None


def _peak_resident(pid: int) -> int | None:
    """VmHWM (bytes), or VmRSS where there is none; None once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = {k: v.split() for k, _, v in (line.partition(":") for line in lines)}
    values = [int(fields[k][0]) * 1024 for k in ("VmHWM", "VmRSS") if k in fields]
    return max(values) if values else None


# ----------------------------------------------------------------------------- a run


def train(
    scratch: Path, label: str, trainer: dict[str, Any], nproc: int, parallel: str,
    steps: int, batch: int, malloc: str = "glibc default",
) -> Run:  # fmt: skip
    """One ``corun train`` process (``nproc`` ranks), its ranks' memory followed."""
    slug = f"{label}-{list(MALLOCS).index(malloc)}".replace(",", "").replace(" ", "-")
    run_dir, config, log = (scratch / slug, scratch / f"{slug}.toml", scratch / f"{slug}.log")
    config.write_text(
        tomli_w.dumps({
            "trainer": trainer,
            "run": {"dir": str(run_dir), "steps": steps, "nproc": nproc, "parallel": parallel},
            "loop": {"baseline_eval": False, "eval_interval": 0, "save_interval": 0},
            "data": {"batch_size": batch},
            "log": {"progress": "off"},
        })
    )  # fmt: skip
    started = time.monotonic()
    with log.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "corun", "train", str(config)],
            env={**os.environ, "WANDB_MODE": "disabled", **MALLOCS[malloc]}, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        memory = RankMemory(child.pid, nproc)
        try:
            code = memory.follow(child, RUN_TIMEOUT_S)
        finally:
            _stop(child)
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{label}: corun train exit status {code}:\n{tail}")
    return measured(label, malloc, nproc, parallel, run_dir, memory, time.monotonic() - started)


def _stop(child: subprocess.Popen[bytes]) -> None:
    """A run still going (a timeout, Ctrl-C): SIGTERM (corun stops every rank), then kill."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def measured(
    label: str, malloc: str, nproc: int, parallel: str, run_dir: Path, memory: RankMemory,
    seconds: float,
) -> Run:  # fmt: skip
    steps = [e["t"] for e in read_records(run_dir / EVENTS_FILE) if e["event"] == "step"]
    metrics = read_records(run_dir / METRICS_FILE)
    weights, optimizer = checkpoint_bytes(run_dir) if nproc == 1 else (0, 0)
    return Run(
        label, malloc, nproc, parallel, memory.peaks_mb(until=max(steps, default=None)),
        memory.peaks_mb(), after_first(metrics, "perf/train_time_s"),
        after_first(metrics, "perf/collective_time_s"), after_first(metrics, "perf/sync_time_s"),
        weights, optimizer, seconds,
    )  # fmt: skip


def after_first(metrics: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` (ms) over the steps after the first (warm-up); 0 if none."""
    values = [r[key] for r in metrics if key in r]
    return 1e3 * statistics.median(values[1:] or values) if values else 0.0


def checkpoint_bytes(run_dir: Path) -> tuple[int, int]:
    """The bytes of the trained weights and of the optimizer state in the run's final
    checkpoint (an hf trainer's: ``model`` and ``optimizer``; memory-mapped, not read)."""
    path = latest(run_dir)
    if path is None:
        raise RuntimeError(f"{run_dir}: no checkpoint")
    tensors = torch.load(path / TENSORS_FILE, map_location="cpu", mmap=True, weights_only=True)
    state = tensors["trainer"]
    return _nbytes(state["model"]), _nbytes(state["optimizer"].get("state", {}))


def _nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_nbytes(v) for v in tree)
    return 0


# ----------------------------------------------------------------------------- the suite


def model(settings: Settings, scratch: Path, note: Note) -> str:
    """The grid's ``trainer.model``: a Llama built by trainers/hf/tiny.py (a process of
    its own: trainers/ is reached through processes and the registry only)."""
    if not settings.hidden:
        return "tiny-llama"
    note(f"building a Llama of hidden {settings.hidden}, {settings.layers} layers")
    path = scratch / f"llama-{settings.hidden}x{settings.layers}"
    subprocess.run(
        [sys.executable, "-m", "trainers.hf.tiny", str(path), "--hidden", str(settings.hidden),
         "--layers", str(settings.layers)], check=True, capture_output=True,
    )  # fmt: skip
    return f"hf:{path}"


def measure(settings: Settings, scratch: Path, note: Note) -> tuple[list[Run], list[Run]]:
    """The hf_sft runs of every layout, then the hf_grpo runs of both syncs."""
    spec = model(settings, scratch, note)
    sft = {"kind": "hf_sft", "model": spec, "lr": 1e-3, "eval_size": 16}
    layouts = []
    for malloc in settings.mallocs:
        for label, nproc, parallel in LAYOUTS:
            note(f"hf_sft, {label}, {malloc}")
            layouts.append(train(scratch, label, sft, nproc, parallel, settings.steps,
                                 settings.batch, malloc))  # fmt: skip
    syncs = []
    for label, extra, nproc, parallel in SYNCS:
        note(f"hf_grpo, {label}")
        grpo = {"kind": "hf_grpo", "model": spec, "engine": "local", "samples_per_prompt": 2,
                "max_new_tokens": 8, "eval_size": 16, **extra}  # fmt: skip
        # A fixed mmap threshold: memory freed after a sync leaves the resident set, so
        # the peak is the sync's, not a heap's high-water mark from training.
        syncs.append(train(scratch, label, grpo, nproc, parallel, settings.syncs, 2 * nproc,
                           "mmap threshold 1 MiB"))  # fmt: skip
    return layouts, syncs


def tables(
    settings: Settings, layouts: list[Run], syncs: list[Run], others: float | None
) -> list[Table]:
    params = layouts[0].weight_bytes // 4  # float32 master weights
    what = f"{params / 1e6:.1f}M-parameter Llama"
    shape = (f"hidden {settings.hidden}, {settings.layers} layers" if settings.hidden
             else "the built-in tiny one")  # fmt: skip
    load = f"The model: {shape}, random weights. {_load_note(others)}"
    return [memory_table(settings, what, layouts, load), sync_table(settings, what, syncs, load)]


def memory_table(settings: Settings, what: str, layouts: list[Run], load: str) -> Table:
    """Each layout under each allocator setting, against 1 rank under the same."""
    one = {r.malloc: r for r in layouts if r.nproc == 1}
    state = 2 * layouts[0].weight_bytes + layouts[0].optimizer_bytes  # + grads, AdamW moments
    share = {r.label: state / (r.nproc if r.parallel == "fsdp" else 1) for r in layouts}

    def memory(r: Run) -> float:
        return max(r.peaks_mb) / max(one[r.malloc].peaks_mb)

    def step(r: Run) -> float:
        return r.step_ms / one[r.malloc].step_ms

    return Table(
        "parallel", "memory", f"hf_sft, {what}: peak memory per rank and step time",
        ["layout", "malloc", "peak RSS per rank, MB", "vs 1 rank",
         "params + grads + AdamW per rank, MB", "step ms (median)", "vs 1 rank",
         "collective ms", "peak RSS to exit, MB"],
        [[r.label, r.malloc, " / ".join(fmt(p, 0) for p in r.peaks_mb), f"{memory(r):.2f}",
          fmt(share[r.label] / MB, 0), fmt(r.step_ms, 0), f"{step(r):.2f}",
          fmt(r.collective_ms, 1), " / ".join(fmt(p, 0) for p in r.exit_peaks_mb)]
         for r in layouts],
        [(f"{r.label}, {r.malloc}: {name}", value(r)) for r in layouts
         for name, value in (("peak memory per rank", memory), ("step time", step))],
        "the 1-rank run, same malloc setting, same global batch, same bench run",
        [f"{settings.steps} steps of {settings.batch} prompts each. Peak RSS: each rank's "
         "VmHWM (by rank) up to its last step; it includes the interpreter, torch and "
         "activations. The model's share (params + grads + AdamW) is from the 1-rank run's "
         "checkpoint, over the ranks under fsdp. malloc: glibc's default, or a fixed mmap "
         "threshold (MALLOC_MMAP_THRESHOLD_=1048576), with which freed FSDP all-gather "
         f"buffers leave the resident set. {load}"],
    )  # fmt: skip


def sync_table(settings: Settings, what: str, syncs: list[Run], load: str) -> Table:
    full = syncs[0]

    def sent(r: Run) -> int:  # a sharded run's checkpoint is not read: the same model
        return r.weight_bytes or full.weight_bytes

    return Table(
        "parallel", "sync", f"hf_grpo weight sync, {what}: full weights vs LoRA adapter",
        ["sync", "bytes sent, MB", "vs full", "sync ms (median)", "vs full",
         "peak RSS per rank, MB"],
        [[r.label, fmt(sent(r) / MB, 2), f"{sent(r) / full.weight_bytes:.4f}",
          fmt(r.sync_ms, 1), f"{r.sync_ms / full.sync_ms:.2f}",
          " / ".join(fmt(p, 0) for p in r.peaks_mb)]
         for r in syncs],
        [(f"{r.label}: sync time", r.sync_ms / full.sync_ms) for r in syncs],
        "the full-weight sync, same model, same bench run",
        [f"{settings.syncs} syncs to the local engine; LoRA rank {LORA['rank']} on the "
         "attention projections. Bytes: the trained weights the run's checkpoint holds, "
         "which is what a sync sends (the adapter's tensors under [trainer.lora]); the "
         "time is the run's perf/sync_time_s (the load and the fingerprint check), after "
         "the first. The 2-rank rows: every rank's engine loads the whole model, gathered "
         "from the shards in buckets as it reads, or all at once (a second whole copy); "
         "each rank's peak RSS is its whole run's, under a fixed mmap threshold so that "
         f"freed memory leaves it. {load}"],
    )  # fmt: skip


def _load_note(others: float | None) -> str:
    if others is None:
        return "How busy the rest of the machine was is unknown (no /proc/stat)."
    busy = "" if others <= BUSY_CPUS else (
        " (more than the quiet bound: other work on the machine, such as other jobs, "
        "disturbed the times; memory is unaffected)"
    )  # fmt: skip
    return f"Other processes kept {others:.2f} CPUs busy on average meanwhile{busy}."


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench parallel``: memory and step time by layout, and the two syncs."""
    settings = GRIDS[grid]
    others = OtherLoad()
    layouts, syncs = measure(settings, scratch, note)
    return tables(settings, layouts, syncs, others.stop())


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--grid", choices=GRIDS, help="full, quick or tiny (the test's)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    settings = GRIDS[args.grid or ("quick" if args.quick else "full")]
    started, others = time.monotonic(), OtherLoad()
    with tempfile.TemporaryDirectory(prefix="corun-bench-parallel-") as scratch:
        layouts, syncs = measure(settings, Path(scratch), lambda text: print(
            f"[parallel] {text}", file=sys.stderr, flush=True))  # fmt: skip
    busy = others.stop()
    print(f"run.parallel on {os.cpu_count()} CPUs ({settings.name} grid)\n")
    for table in tables(settings, layouts, syncs, busy):
        print("\n".join(markdown_table(table, plot=False)))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        figures = {"settings": asdict(settings), "others_cpus": busy,
                   "layouts": [asdict(r) for r in layouts],
                   "syncs": [asdict(r) for r in syncs]}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
