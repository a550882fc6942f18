"""The Tinker API's overhead: the latency of each training-API call made through the
official SDK (``tinker`` 0.38, synchronous ``.result()`` calls) against ``corun serve
tinker`` in a child process, next to the same call made in process on the same kind
of model (the ``hf_sft`` trainer's training backend, through the registry, on a lane
made as the server makes its own). The built-in tiny Llama, rank-8 LoRA adapters
seeded alike on both sides, the same data and sampling seeds. The ``tinker`` suite of
``corun bench``, and a program of its own::

    python -m benchmarks.tinker                        # ~70 s on 2 CPUs
    python -m benchmarks.tinker --quick --json out.json  # ~30 s (the test's)

The calls, each timed on its own, in rounds that alternate which side goes first:
``forward_backward`` (cross_entropy) of 1 and 8 sequences of 64 tokens, ``optim_step``
(AdamW), ``forward_backward`` of 8 and ``optim_step`` submitted together before
either's ``.result()`` (the SDK pipelines them; in process they run one after the
other), and ``sample`` of 1 and 4 continuations of 16 tokens (a 16-token prompt, no
stop: every continuation runs to 16 tokens) from the adapters saved for sampling at
the start. Overhead is the SDK's p50 latency over the in-process one: HTTP, protobuf
or JSON both ways, the server's futures and the client's polls.

The work is the same on both sides, and checked: every continuation's length, and the
losses the two models report call after call (their largest relative difference is a
figure). The server is a child process, as a client's is (the SDK's threads and its
event loop stay out of the server's), started with ``corun serve tinker`` and stopped
with SIGINT however the run ends. Nothing is asserted about timings: they belong here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from anyio.from_thread import start_blocking_portal

from benchmarks.quiet import OtherLoad
from benchmarks.report import Note, Table, fmt, markdown_table
from benchmarks.serve_child import serving
from benchmarks.setup import set_up
from corun.base.config import Config
from corun.contract.config_file import load_config
from corun.contract.engine import Sampling
from corun.contract.training_api import AdamStep, Datum, LoraShape, TrainingBackend
from corun.execution.compute import Lane
from corun.loop.lanes import lane
from corun.recipes import shipped

if TYPE_CHECKING:
    import tinker
    from tinker import types

RECIPE = "tinker"  # configs/tinker.toml: hf_sft on the built-in tiny Llama
BASE_MODEL = "tiny-llama"
API_KEY = "tml-corun-bench"  # any tml- key
RANK, SEED, LEARNING_RATE = 8, 0, 1e-4
TOKENS = 64  # a training sequence's
PROMPT_TOKENS, MAX_TOKENS = 16, 16
ID_RANGE = 256  # token ids drawn below this: inside the tiny model's vocabulary (341)
CALLS = {  # key: the row's label
    "fb1": "forward_backward, 1 x 64 tokens",
    "fb8": "forward_backward, 8 x 64 tokens",
    "optim": "optim_step (AdamW, rank 8)",
    "step8": "forward_backward 8 x 64 + optim_step, pipelined",
    "sample1": "sample, 1 x 16 tokens",
    "sample4": "sample, 4 x 16 tokens",
}


@dataclass(frozen=True)
class Settings:
    name: str
    rounds: int  # timed rounds: each call once per side
    warmup: int  # untimed rounds first (the first pass, the sampling engine's start)


GRIDS = {
    "full": Settings("full", 100, 3),
    "quick": Settings("quick", 12, 2),
    "tiny": Settings("tiny", 5, 1),
}


@dataclass
class Row:
    call: str
    label: str
    sdk_ms: list[float]
    direct_ms: list[float]
    sdk_p50_ms: float = 0.0
    sdk_p90_ms: float = 0.0
    direct_p50_ms: float = 0.0
    direct_p90_ms: float = 0.0
    overhead_ms: float = 0.0  # SDK p50 - in-process p50
    ratio: float = 0.0  # SDK p50 / in-process p50

    def __post_init__(self) -> None:
        self.sdk_p50_ms, self.sdk_p90_ms = percentile(self.sdk_ms, 50), percentile(self.sdk_ms, 90)
        self.direct_p50_ms = percentile(self.direct_ms, 50)
        self.direct_p90_ms = percentile(self.direct_ms, 90)
        self.overhead_ms = self.sdk_p50_ms - self.direct_p50_ms
        self.ratio = self.sdk_p50_ms / self.direct_p50_ms if self.direct_p50_ms > 0 else math.inf


@dataclass
class Figures:
    settings: Settings
    rows: list[Row]
    loss_max_rel_diff: float  # between the two sides' losses, call by call
    same_samples: float  # the fraction of sample calls whose tokens were the same
    server_start_s: float
    others_cpus: float | None = None
    elapsed_s: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 of nothing)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def progress(message: str) -> None:
    print(f"[tinker] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the work


@dataclass(frozen=True)
class Work:
    """What both sides compute: 8 sequences (the first one for the 1-sequence call) and
    the prompt, drawn once."""

    sequences: list[list[int]]  # TOKENS + 1 ids: the inputs and, shifted, the targets
    prompt: list[int]

    @classmethod
    def draw(cls) -> Work:
        rng = random.Random(SEED)
        sequences = [[rng.randrange(ID_RANGE) for _ in range(TOKENS + 1)] for _ in range(8)]
        return cls(sequences, [rng.randrange(ID_RANGE) for _ in range(PROMPT_TOKENS)])


@dataclass
class Side:
    """One side's record: seconds per call and round, the losses in call order, and
    the tokens each sample call drew."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in CALLS})
    losses: list[float] = field(default_factory=list)
    samples: list[list[list[int]]] = field(default_factory=list)

    @contextmanager
    def timed(self, key: str, keep: bool) -> Iterator[None]:
        started = time.perf_counter()
        yield
        if keep:
            self.seconds[key].append(time.perf_counter() - started)

    def sampled(self, sequences: list[list[int]], keep: bool) -> None:
        if any(len(tokens) != MAX_TOKENS for tokens in sequences):
            lengths = [len(tokens) for tokens in sequences]
            raise RuntimeError(f"sample: {lengths} tokens, expected {MAX_TOKENS} each")
        if keep:
            self.samples.append(sequences)


# ----------------------------------------------------------------------------- the SDK side


class SdkSide(Side):
    """A training client of the served tiny Llama, and a sampling client of its
    adapters as created (saved for sampling once, before the rounds)."""

    def __init__(self, service: tinker.ServiceClient, work: Work) -> None:
        from tinker import types

        super().__init__()
        self.training = service.create_lora_training_client(
            base_model=BASE_MODEL, rank=RANK, seed=SEED
        ).result()
        self.data = [self.datum(tokens) for tokens in work.sequences]
        self.prompt = types.ModelInput.from_ints(work.prompt)
        self.adam = types.AdamParams(learning_rate=LEARNING_RATE)
        self.sampler = self.training.save_weights_and_get_sampling_client().result()

    @staticmethod
    def datum(tokens: list[int]) -> types.Datum:
        from tinker import types

        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[TOKENS]),
                "weights": types.TensorData(data=[1.0] * TOKENS, dtype="float32", shape=[TOKENS]),
            },
        )

    def round(self, seed: int, keep: bool) -> None:
        from tinker import types

        for key, size in (("fb1", 1), ("fb8", 8)):
            with self.timed(key, keep):
                result = self.training.forward_backward(self.data[:size], "cross_entropy").result()
            self.losses.append(result.metrics["loss:sum"])
        with self.timed("optim", keep):
            self.training.optim_step(self.adam).result()
        with self.timed("step8", keep):
            backward = self.training.forward_backward(self.data, "cross_entropy")
            step = self.training.optim_step(self.adam)
            self.losses.append(backward.result().metrics["loss:sum"])
            step.result()
        for key, count in (("sample1", 1), ("sample4", 4)):
            params = types.SamplingParams(max_tokens=MAX_TOKENS, seed=seed, stop=[])
            with self.timed(key, keep):
                reply = self.sampler.sample(self.prompt, count, params).result()
            self.sampled([list(s.tokens) for s in reply.sequences], keep)


# ----------------------------------------------------------------------------- in process


class DirectSide(Side):
    """The same calls on the in-process backend's model, on a lane made as the server
    makes its own (corun/host/runs.py); timed inside the event loop, so what is timed
    is the model's work and the lane's thread hop."""

    def __init__(self, backend: TrainingBackend, serve_lane: Lane, work: Work, saved: Path) -> None:
        super().__init__()
        self.backend, self.lane, self.saved = backend, serve_lane, saved
        self.data = [
            Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                "weights": torch.ones(TOKENS)})
            for tokens in work.sequences
        ]  # fmt: skip
        self.prompt = work.prompt
        self.adam = AdamStep(LEARNING_RATE)

    async def start(self) -> None:
        """The model, and its adapters saved for sampling (as the SDK side's)."""
        self.model = await self.lane.run(
            self.backend.create_model, BASE_MODEL, LoraShape(RANK), SEED
        )
        await self.lane.run(partial(self.model.save, self.saved, optimizer=False))

    async def backward(self, size: int) -> None:
        result = await self.lane.run(
            self.model.forward_backward, self.data[:size], "cross_entropy", {}, True
        )
        self.losses.append(result.metrics["loss:sum"])

    async def round(self, seed: int, keep: bool) -> None:
        for key, size in (("fb1", 1), ("fb8", 8)):
            with self.timed(key, keep):
                await self.backward(size)
        with self.timed("optim", keep):
            await self.lane.run(self.model.optim_step, self.adam)
        with self.timed("step8", keep):
            await self.backward(8)
            await self.lane.run(self.model.optim_step, self.adam)
        sampling = Sampling(MAX_TOKENS, 1.0, 1.0)
        for key, count in (("sample1", 1), ("sample4", 4)):
            with self.timed(key, keep):
                done = await self.backend.sample(
                    self.saved, [self.prompt] * count, sampling, seed, stop_at_eos=False
                )
            self.sampled([g.ids for g in done], keep)


@asynccontextmanager
async def direct_backend(config: Config) -> AsyncIterator[tuple[TrainingBackend, Lane]]:
    """The recipe's trainer set up through the registry, as ``corun serve`` sets it up,
    its training backend and a serve lane; all of it torn down on the way out."""
    async with AsyncExitStack() as stack:
        trainer = await set_up(config, stack, train_lane=True)
        backend = trainer.training_backend()
        if backend is None:
            raise RuntimeError(f"trainer {config.trainer.kind!r} serves no training API")
        serve_lane = lane(config, "serve")
        stack.callback(serve_lane.close)
        stack.push_async_callback(backend.close)
        yield backend, serve_lane


# ----------------------------------------------------------------------------- a run


def measure(settings: Settings, folder: Path) -> Figures:
    """Both sides, round after round (see the module's docstring)."""
    try:
        import tinker
    except ImportError:
        needs = "the tinker suite needs the Tinker SDK: pip install 'corun[tinker]'"
        raise RuntimeError(needs) from None

    os.environ["TINKER_TELEMETRY"] = "0"  # its reports would be traffic beside the calls
    recipe = shipped(RECIPE)
    assert recipe is not None, f"corun ships the {RECIPE} recipe"
    config = load_config(recipe, [f"run.dir={folder / 'direct'}"])
    work = Work.draw()
    with (
        serving(folder, RECIPE) as server,
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(direct_backend(config)) as (backend, serve_lane),
    ):
        direct = DirectSide(backend, serve_lane, work, folder / "direct" / "sampler")
        portal.call(direct.start)
        url = server.url()
        server_start = time.monotonic() - server.started
        progress(f"serving {url} after {server_start:.1f} s")
        with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
            sdk = SdkSide(service, work)
            for index in range(settings.warmup + settings.rounds):
                keep, seed = index >= settings.warmup, 1000 + index
                if index % 2:
                    sdk.round(seed, keep)
                    portal.call(direct.round, seed, keep)
                else:
                    portal.call(direct.round, seed, keep)
                    sdk.round(seed, keep)
    return figures(settings, sdk, direct, server_start)


def figures(settings: Settings, sdk: SdkSide, direct: DirectSide, server_start: float) -> Figures:
    rows = [
        Row(key, label, [s * 1e3 for s in sdk.seconds[key]], [s * 1e3 for s in direct.seconds[key]])
        for key, label in CALLS.items()
    ]
    pairs = list(zip(sdk.losses, direct.losses, strict=True))
    loss_diff = max(abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in pairs)
    same = [a == b for a, b in zip(sdk.samples, direct.samples, strict=True)]
    return Figures(settings, rows, loss_diff, sum(same) / max(1, len(same)), server_start)


# ----------------------------------------------------------------------------- the table


def table(figures: Figures) -> Table:
    rows = figures.rows
    notes = [
        f"{figures.settings.rounds} rounds after {figures.settings.warmup} of warm-up; the "
        "server a `corun serve tinker` child process, the client the SDK's synchronous "
        "`.result()`; in process: the same model calls on a lane made as the server's.",
        f"Same work: losses agree to {figures.loss_max_rel_diff:.1e} (largest relative "
        f"difference, call by call); {figures.same_samples:.0%} of sample calls drew the "
        "same tokens on both sides.",
    ]
    return Table(
        "tinker", "overhead", f"Tinker API: SDK calls vs the same calls in process "
        f"(tiny Llama, LoRA rank {RANK})",
        ["call", "SDK p50 ms", "SDK p90 ms", "in process p50 ms", "in process p90 ms",
         "overhead p50 ms", "SDK / in process"],
        [[r.label, fmt(r.sdk_p50_ms, 1), fmt(r.sdk_p90_ms, 1), fmt(r.direct_p50_ms, 1),
          fmt(r.direct_p90_ms, 1), fmt(r.overhead_ms, 1), f"{r.ratio:.2f}"] for r in rows],
        [(r.label, r.ratio) for r in rows],
        "the same call in process (on a serve lane), same data and seeds, same run",
        notes,
    )  # fmt: skip


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench tinker``: each call's latency through the SDK and in process."""
    settings = GRIDS[grid]
    note(f"{settings.rounds} rounds of {len(CALLS)} calls a side")
    return [table(measure(settings, scratch))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (~30 s)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--grid", choices=GRIDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = GRIDS[args.grid or ("quick" if args.quick else "full")]
    signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: the server stopped, then out
    others, started = OtherLoad(), time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="corun-bench-tinker-") as folder:
            result = measure(settings, Path(folder))
    except KeyboardInterrupt:
        return 130
    result.others_cpus, result.elapsed_s = others.stop(), time.monotonic() - started
    busy = "unknown" if result.others_cpus is None else f"{result.others_cpus:.2f}"
    print(f"the Tinker API on the built-in tiny Llama ({settings.name}; {os.cpu_count()} "
          f"CPUs; other processes kept {busy} CPUs busy on average; load average now "
          f"{os.getloadavg()[0]:.2f})\n")  # fmt: skip
    print("\n".join(markdown_table(table(result), plot=False)))
    print(f"({result.elapsed_s:.0f} s; the server started in {result.server_start_s:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
