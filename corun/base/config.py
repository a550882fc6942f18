"""Configuration: TOML decoded by msgspec into frozen Structs.

Every section forbids unknown fields, so a typo (`loop.concurency`) is an error that
names the place instead of a setting silently ignored. Reading a file, applying
command-line overrides and decoding `[trainer]` with the trainer's own Struct live in
corun/contract/config_file.py.
"""

from __future__ import annotations

import hashlib
import math
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from corun.base.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
# Every RNG takes it: torch's up to 64 bits, numpy's (data shuffling) non-negative only.
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# Threads or processes, one each: a larger number is a typo that would hang set-up
# (and torch.set_num_threads takes a C int).
Lanes = Annotated[int, msgspec.Meta(ge=1, le=1024)]


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: immutable, unknown keys rejected."""


class RunConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = "run"
    # Where checkpoints, metrics, events and the trace go; default runs/<name>.
    dir: str = ""
    seed: Seed = 0
    # Total optimizer steps; a resumed run continues up to this number.
    steps: NonNegativeInt = 100
    backend: Literal["asyncio", "trio"] = "asyncio"
    # Where the trainer's models, optimizer state and batches live
    # (corun/execution/device.py): "auto" (this process's GPU when torch sees CUDA, else
    # the CPU), "cpu", "cuda" (refused at start without one) or "cuda:N".
    device: Annotated[str, msgspec.Meta(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    # Each teardown step gets this long before it is abandoned and the next one runs.
    teardown_timeout_s: PositiveFloat = 30.0
    # After the first SIGINT/SIGTERM the process ends by this deadline, whatever hangs.
    hard_deadline_s: PositiveFloat = 60.0
    # Data-parallel processes on this machine: `corun train` launches torchrun with
    # this many ranks (corun/scale/launch.py); 1 trains in this process.
    nproc: Lanes = 1
    # Several machines ("nodes"; corun/scale/launch.py): `corun train` on each with the
    # same config, run.nnodes = N, its own run.node_rank (0 .. N-1; node 0 holds global
    # rank 0 and the rendezvous) and node 0's address, run.rdzv_endpoint = "HOST:PORT";
    # run.nproc ranks on each, and run.dir on a filesystem every node shares.
    nnodes: PositiveInt = 1
    node_rank: NonNegativeInt = 0
    rdzv_endpoint: Annotated[str, msgspec.Meta(pattern=r"^$|^[^\s:]+:[0-9]{1,5}$")] = ""
    # How a model that supports it is spread over those ranks (corun/execution/parallel.py):
    # "ddp" replicates it on every rank and averages gradients (fastest while the model
    # and its optimizer state fit one device); "fsdp" shards parameters, gradients and
    # optimizer state over the ranks (memory per rank falls with run.nproc, at an
    # all-gather per block and step). No effect at run.nproc = 1.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # A collective (gradient all-reduce) that takes longer fails the run: a dead or
    # hung rank ends it within this time instead of hanging it.
    collective_timeout_s: PositiveFloat = 300.0
    # A weight sync (the trainer's sync_weights and the Ray publish) that takes longer
    # fails the run with one line; a call stuck in a lane thread is abandoned
    # (corun/loop/deadlines.py).
    sync_timeout_s: PositiveFloat = 600.0
    # Deadlines on the trainer's own code the loop waits on; an overrun fails the run
    # with one line naming it (corun/loop/deadlines.py). Far above a healthy call, well
    # below "until someone notices": each baseline or periodic evaluation (held-out
    # generation of a large model takes minutes);
    eval_timeout_s: PositiveFloat = 1800.0
    # each batch fetched from the trainer's dataset (a file is milliseconds; a remote or
    # streaming source may stall on the network);
    data_timeout_s: PositiveFloat = 300.0
    # each reward function call on one sample (a verifier, a sandboxed test run or an
    # HTTP judge), the sample's prompt named in the line.
    reward_timeout_s: PositiveFloat = 60.0

    def __post_init__(self) -> None:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"`node_rank` = {self.node_rank} is not a node of `nnodes` = {self.nnodes} "
                f"(0 .. {self.nnodes - 1})"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f'`rdzv_endpoint` = "": `nnodes` = {self.nnodes} needs node 0\'s '
                '"HOST:PORT", the same on every node'
            )

    @property
    def world_size(self) -> int:
        """Ranks over every node."""
        return self.nnodes * self.nproc


class LoopConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Rollout batches generated or buffered ahead of the trainer; 1 = synchronous.
    concurrency: PositiveInt = 1
    # A batch made with weights more than this many versions old is never trained on.
    # Unset: the lag that concurrency and sync_interval cause anyway (staleness_bound).
    max_staleness: NonNegativeInt | None = None
    # Steps per weight publish to the rollout engine; unset: every update (every
    # `accumulate` steps).
    sync_interval: PositiveInt | None = None
    # Rollout batches (steps) per update: a window of this many batches accumulates
    # gradients and the update is applied at its end, advancing the policy version by
    # one. Sync, eval and save intervals and run.steps must then be multiples of it
    # (weights change only at window ends). max_staleness counts versions.
    accumulate: PositiveInt = 1
    # Optimizer steps per update: each on a disjoint slice (mini-batch) of every batch
    # of the window. The version still advances once per update.
    mini_batches: PositiveInt = 1
    # Memory: the most tokens (rows x the longest row among them) one backward pass
    # holds. Each mini-batch of a trainer that reports its rows' lengths is split into
    # micro-batches of rows grouped by length, each cut to its own longest row, under
    # this budget (a row over it goes alone); their gradients add up to the unsplit
    # update's. 0: never split. A smaller budget holds less and takes longer
    # (docs/memory.md). The default fits every shipped recipe's batch whole (the
    # longest, hf_agentic's 64 multi-turn rows, comes to ~16k tokens).
    micro_batch_tokens: NonNegativeInt = 32768
    # And at most this many rows per micro-batch (0: no cap).
    micro_batch_rows: NonNegativeInt = 0
    # Which weights a rollout uses when concurrency > 1. "free": the latest published
    # (highest throughput; timing decides the version, so runs are not reproducible).
    # "fixed": the version a schedule assigns to its data index (a function of the
    # index, concurrency, accumulate, sync_interval and max_staleness): two runs with
    # the same seed are bitwise equal whatever the timings, and so is a resumed one.
    # Needs order = "start"; checkpoints then hold the older weights still scheduled.
    version_schedule: Literal["free", "fixed"] = "free"
    # Rollout workers, each on its own compute lane, when concurrency > 1 (at
    # concurrency 1 rollouts share the train lane: generate and train never overlap).
    workers: Lanes = 1
    # Order the trainer takes batches in when concurrency > 1: "start" (the order
    # their rollouts started; deterministic) or "completion" (as each finishes; the
    # trainer never waits behind a slow rollout, and an overtaken batch that ends
    # up over max_staleness is dropped and generated again).
    order: Literal["start", "completion"] = "start"
    # torch intra-op threads for each lane (the train lane and, when concurrency > 1,
    # every rollout worker's); 0: the machine's cores split among lanes that overlap,
    # fixed for the run, so float rounding (and the weights a seed gives) never depends
    # on the machine's load (corun/execution/cores.py).
    lane_threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    # With lane_threads 0: follow the cores other processes leave free instead (re-read
    # four times a second). Faster beside busy processes when torch's threads spin, but
    # the same seed then gives weights that depend on the machine's load.
    adapt_threads: bool = False
    # The learning rate over the run (corun/loop/schedule.py): "constant" leaves each
    # optimizer's rate alone; "linear" and "cosine" decay it from its value, after
    # lr_warmup updates of linear warm-up, to lr_final of it at the last update.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup: NonNegativeInt = 0
    lr_final: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # The steps the decay spans (0: run.steps). A run resumed with more run.steps keeps
    # the curve it started on with lr_horizon = its first run.steps; without it the
    # horizon moves and the rate jumps (a line at the resume says so).
    lr_horizon: NonNegativeInt = 0
    # Steps between periodic evals / saves; 0 turns them off.
    eval_interval: NonNegativeInt = 0
    save_interval: NonNegativeInt = 0
    baseline_eval: bool = True
    # Save a checkpoint during teardown after an interrupt (skipped on a second signal).
    save_on_interrupt: bool = True
    # "thread": blocking compute on worker threads (the loop stays responsive);
    # "inline": on the event loop, lowest overhead, Ctrl-C waits for the call.
    compute: Literal["thread", "inline"] = "thread"

    def __post_init__(self) -> None:
        for name in ("sync_interval", "eval_interval", "save_interval"):
            if (getattr(self, name) or 0) % self.accumulate:
                raise ValueError(
                    f"`{name}` = {getattr(self, name)} is not a multiple of `accumulate` = "
                    f"{self.accumulate}: weights change only at the end of a window"
                )
        lag = self.sync_every // self.accumulate - 1
        if self.max_staleness is not None and self.max_staleness < lag:
            # Between two publishes the engine lags up to this many versions; a
            # tighter bound would admit no rollout and the run would wait forever.
            raise ValueError(
                f"`max_staleness` = {self.max_staleness} is below the {lag} versions the "
                "engine lags between publishes (`sync_interval` / `accumulate` - 1), so no "
                "rollout could ever be admitted"
            )

        if self.version_schedule == "fixed" and self.order != "start":
            raise ValueError(
                '`version_schedule` = "fixed" needs `order` = "start": in completion order '
                "timing decides which batch trains when"
            )
        if self.workers > self.concurrency:
            raise ValueError(
                f"`workers` = {self.workers} exceeds `concurrency` = {self.concurrency}: no more "
                "than concurrency batches are ever in flight"
            )
        if self.save_interval and self.save_interval % self.sync_every:
            # A checkpoint between two publishes cannot hold the weights the engine is
            # sampling with; resuming from it would republish newer ones.
            raise ValueError(
                f"`save_interval` = {self.save_interval} is not a multiple of `sync_interval` = "
                f"{self.sync_every}: periodic checkpoints must fall on weight publishes"
            )

    @property
    def staleness_bound(self) -> int:
        """In versions: by default the lag that concurrency and sync_interval cause."""
        if self.max_staleness is not None:
            return self.max_staleness
        ahead = -(-(self.concurrency - 1) // self.accumulate)  # windows the queue spans
        return ahead + self.sync_every // self.accumulate - 1

    @property
    def sync_every(self) -> int:
        return self.sync_interval or self.accumulate


class RolloutConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[rollout]``: where the rollout workers (``loop.workers``) run
    (corun/scale/ray_workers.py)."""

    # "thread": a compute lane per worker in this process. "ray": a Ray actor per
    # worker, each with the trainer's rollout side (its engine replica); needs the
    # `ray` extra and a trainer with rollout_weights/load_rollout_weights.
    backend: Literal["thread", "ray"] = "thread"
    # An existing Ray cluster ("ray://host:10001", "host:6379", "auto"); empty: corun
    # starts a local one for the run (in a process group it owns) and stops it after.
    address: str = ""
    # CPUs of the local cluster; unset: one per worker (actor_cpus each).
    num_cpus: PositiveInt | None = None
    actor_cpus: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # Custom Ray resources each actor needs, e.g. {worker = 1}: the actors land only on
    # the nodes started with them (`ray start --resources='{"worker": 4}'`); refused at
    # start, in one line, when no node of the cluster has them.
    resources: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(default_factory=dict)
    # A rollout call that takes longer counts as a dead worker (its actor is killed).
    call_timeout_s: PositiveFloat = 600.0
    # Cluster start, actor start (model build) and each actor's shutdown.
    start_timeout_s: PositiveFloat = 120.0
    # A worker that died mid-rollout: "redo" its batch on a live worker (the run fails
    # only when none is left), or "fail" the run with one line.
    on_worker_lost: Literal["redo", "fail"] = "redo"
    # A fleet of engine servers (trainer.engine = "remote"): with no member serving, a
    # rollout waits this long for one to come back, then the run fails in one line.
    fleet_timeout_s: PositiveFloat = 300.0


class CheckpointConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # true: resume from the latest complete checkpoint in run.dir if there is one;
    # false: start fresh (refused if run.dir already holds checkpoints);
    # a path: resume from that checkpoint directory.
    resume: bool | str = True
    # Keep only the newest N checkpoints; 0 keeps all.
    keep: NonNegativeInt = 0
    # Save finished rollout batches the trainer has not trained yet (async mode: the
    # stream and reorder buffer; after a stop, the batch cut short and a rewound
    # window's) with each checkpoint, and train them first after resume: no finished
    # rollout is thrown away and generated again (corun/loop/kept_rollouts.py). Costs
    # checkpoint size and write time per kept batch; refused under torchrun.
    keep_rollouts: bool = False
    # A checkpoint write (in the background) that takes longer fails the run with one
    # line and leaves the previous checkpoint the latest: a wedged disk or network file
    # system. Minutes for gigabytes to slow storage; the same default as a weight sync.
    write_timeout_s: PositiveFloat = 600.0


class LogConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "corun"
    # "auto": a rich progress bar on a terminal, plain lines otherwise.
    progress: Literal["auto", "rich", "plain", "off"] = "auto"


def secret(value: str, where: str) -> str:
    """A token setting's value, or the environment variable it names (``env:NAME``)."""
    if not value.startswith("env:"):
        return value
    name = value.removeprefix("env:")
    found = os.environ.get(name)
    if not found:
        raise ConfigError(f"{where} = {value!r}: ${name} is not set")
    return found


class ServeConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[serve]``: the OpenAI-compatible policy endpoint (corun/serve/), served from the
    current rollout weights during a run (and by ``corun serve``)."""

    enabled: bool = False
    # Set by `corun engine serve`: the trainer's rollout engine for a training run's
    # fleet (corun/serve/engine_server.py) in place of the endpoint.
    fleet: bool = False
    # Loopback by default: the endpoint has no TLS, so exposing it is a decision.
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: any free port
    # Required as "Authorization: Bearer <token>" when set; "env:NAME" reads $NAME.
    token: str = ""
    # Concurrent requests generated together: up to this many replies per batch (a
    # request with n = 2 counts twice), gathered for up to batch_wait_ms after the
    # first one arrives.
    max_batch: PositiveInt = 64
    batch_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    # An episode recorded through the endpoint and never finished is dropped after this.
    episode_ttl_s: PositiveFloat = 600.0
    # `corun serve` only: serve the Tinker training API (corun/serve/tinker/, the SDK
    # `tinker` 0.38) instead of the OpenAI-compatible endpoint: clients create LoRA
    # models of the trainer's base model and train and sample them step by step.
    tinker: bool = False
    # Tinker: requests waiting per model (beyond: refused, the client retries), and
    # finished results kept for clients to collect (the oldest dropped first).
    tinker_queue: PositiveInt = 256
    tinker_results: PositiveInt = 4096
    # Tinker: models held in memory at once (0: no bound). Past it, the least recently
    # used model without pending gradients is saved (adapters and optimizer state) and
    # dropped, and reloaded from that save on its next request.
    tinker_max_models: Annotated[int, msgspec.Meta(ge=0)] = 0


class TaskConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[data.tasks.<name>]``: one task of a generated data source."""

    # Its share of the items (relative to the other tasks' weights); positive and
    # finite (checked by DataConfig, naming the task), so a task named in the mix is
    # never silently absent from it, nor the only one present.
    weight: float = 1.0
    # The task's own settings, passed to its generator as they are (e.g. reasoning-gym's
    # min_terms, max_digits); checked by the generator when the trainer starts.
    settings: dict[str, Any] = msgspec.field(default_factory=dict)


class DataConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # A JSONL file of records; empty means the trainer's built-in generator.
    path: str = ""
    batch_size: PositiveInt = 64
    shuffle: bool = True
    # A generated data source in place of the file or the built-in task: its items
    # made from the run's seed and their index ("reasoning-gym": its procedural tasks,
    # the `reasoning-gym` extra; trainers/hf/reasoning_gym.py), the tasks it draws
    # from named in [data.tasks.<name>].
    source: Literal["", "reasoning-gym"] = ""
    tasks: dict[str, TaskConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Each half without the other would be ignored; a file beside a source would be
        # one of them silently unused.
        if self.tasks and not self.source:
            raise ValueError("`tasks` name a generated source's tasks: set `source` too")
        if self.source and not self.tasks:
            raise ValueError(f"`source` = {self.source!r} needs tasks: [data.tasks.<name>]")
        if self.source and self.path:
            raise ValueError(
                f"`path` and `source` = {self.source!r} are two data sources: keep one"
            )
        for name, task in self.tasks.items():
            if not 0 < task.weight < math.inf:
                raise ValueError(f"`tasks.{name}.weight` = {task.weight}: give a positive weight")


class TrainerConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of a trainer's own settings; `kind` names the trainer class."""

    kind: str


class Config(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    trainer: TrainerConfig
    run: RunConfig = RunConfig()
    loop: LoopConfig = LoopConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    data: DataConfig = DataConfig()
    serve: ServeConfig = ServeConfig()
    rollout: RolloutConfig = RolloutConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    def digest(self) -> str:
        """Hash of what defines the run's trajectory (not its length, logging or resume)."""
        stable = {
            "trainer": self.trainer,
            "data": self.data,
            "loop": self.loop,
            "seed": self.run.seed,
        }
        return hashlib.sha256(msgspec.json.encode(stable)).hexdigest()[:16]


# ----------------------------------------------------------------------------- overrides


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``KEY.PATH=VALUE`` in the raw tables; VALUE is read as TOML, else as a string."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(part.strip() for part in parts):
        raise ConfigError(
            f"override {override!r}: expected KEY.PATH=VALUE, e.g. loop.concurrency=2"
        )
    table = raw
    for depth, part in enumerate(parts[:-1]):
        node = table.setdefault(part.strip(), {})
        if not isinstance(node, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {override!r}: `$.{where}` is a value, not a table")
        table = node
    table[parts[-1].strip()] = parse_value(text.strip())


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # deep nesting: not a TOML value either
        return text


def to_toml(config: Config) -> str:
    """The resolved config as TOML; unset optional values (None) are left out."""
    return msgspec.toml.encode(_without_none(msgspec.to_builtins(config))).decode()


def _without_none(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _without_none(v) for k, v in tree.items() if v is not None}
    return tree
