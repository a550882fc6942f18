"""Configuration: TOML decoded by msgspec into frozen Structs.

Every section forbids unknown fields, so a typo (`loop.concurency`) is an error that
names the place instead of a setting silently ignored. `[trainer]` is validated in
two passes: `kind` picks the trainer class, whose own `Config` Struct then decodes
the rest of the table. Command-line overrides (`KEY.PATH=VALUE`) are applied to the
raw TOML tables before decoding, so they get the same checks as the file.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from corun.errors import ConfigError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: immutable, unknown keys rejected."""


class RunConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = "run"
    # Where checkpoints, metrics, events and the trace go; default runs/<name>.
    dir: str = ""
    seed: int = 0
    # Total optimizer steps; a resumed run continues up to this number.
    steps: NonNegativeInt = 100
    backend: Literal["asyncio", "trio"] = "asyncio"
    # Each teardown step gets this long before it is abandoned and the next one runs.
    teardown_timeout_s: PositiveFloat = 30.0
    # After the first SIGINT/SIGTERM the process ends by this deadline, whatever hangs.
    hard_deadline_s: PositiveFloat = 60.0


class LoopConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Rollout batches generated or buffered ahead of the trainer; 1 = synchronous.
    concurrency: PositiveInt = 1
    # A batch made with weights more than this many versions old is never trained on.
    # Unset: (concurrency - 1) + (sync_interval - 1), the lag the pipeline has anyway.
    max_staleness: NonNegativeInt | None = None
    # Steps per weight publish to the rollout engine; unset: every update (every
    # `accumulate` steps).
    sync_interval: PositiveInt | None = None
    # Rollout batches (steps) per optimizer update: a window of this many train_step
    # calls accumulates gradients and the last one applies them. Sync, eval and save
    # intervals and run.steps must then be multiples of it (weights change only at
    # window ends). Counts of versions (max_staleness) are in optimizer updates.
    accumulate: PositiveInt = 1
    # Rollout workers, each on its own compute lane, when concurrency > 1 (at
    # concurrency 1 rollouts share the train lane: generate and train never overlap).
    workers: PositiveInt = 1
    # Order the trainer takes batches in when concurrency > 1: "start" (the order
    # their rollouts started; deterministic) or "completion" (as each finishes; the
    # trainer never waits behind a slow rollout, and an overtaken batch that ends
    # up over max_staleness is dropped and generated again).
    order: Literal["start", "completion"] = "start"
    # torch intra-op threads for each lane (the train lane and, when concurrency > 1,
    # every rollout worker's); 0 keeps torch's default. Lanes run side by side, so on
    # a small machine give each a share of the cores; on a machine shared with other
    # jobs, 1 avoids oversubscribing the cores (thread compute only).
    lane_threads: NonNegativeInt = 0
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
        """In optimizer updates (versions): by default the lag the pipeline has anyway."""
        if self.max_staleness is not None:
            return self.max_staleness
        ahead = -(-(self.concurrency - 1) // self.accumulate)  # windows the queue spans
        return ahead + self.sync_every // self.accumulate - 1

    @property
    def sync_every(self) -> int:
        return self.sync_interval or self.accumulate


class CheckpointConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # true: resume from the latest complete checkpoint in run.dir if there is one;
    # false: start fresh (refused if run.dir already holds checkpoints);
    # a path: resume from that checkpoint directory.
    resume: bool | str = True
    # Keep only the newest N checkpoints; 0 keeps all.
    keep: NonNegativeInt = 0


class LogConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "corun"
    # "auto": a rich progress bar on a terminal, plain lines otherwise.
    progress: Literal["auto", "rich", "plain", "off"] = "auto"


class DataConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # A JSONL file of records; empty means the trainer's built-in generator.
    path: str = ""
    batch_size: PositiveInt = 64
    shuffle: bool = True


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


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read, override and validate a config file; raise ConfigError with one clear line."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    for override in overrides:
        apply_override(raw, override)
    return config_from_dict(raw, source=str(path), overrides=overrides)


def config_from_dict(
    raw: dict[str, Any], source: str = "<config>", overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    from corun.trainer import resolve_trainer  # the registry imports config types

    def fail(exc: msgspec.ValidationError, prefix: str = "") -> ConfigError:
        message = str(exc).replace("`$", f"`${prefix}")
        if " - at `$" not in message:  # msgspec names no path for the top level
            message += f" - at `${prefix}`"
        culprit = _override_for(message, overrides)
        return ConfigError(f"{source}: {message}{culprit}")

    trainer_raw = raw.get("trainer")
    if not isinstance(trainer_raw, dict) or not isinstance(trainer_raw.get("kind"), str):
        raise ConfigError(
            f"{source}: Expected `str` at `$.trainer.kind`: a [trainer] table with kind = "
            '"<registered name>" or "package.module:Class" is required'
        )
    trainer_cls = resolve_trainer(trainer_raw["kind"], where=f"{source}: `$.trainer.kind`")
    try:
        trainer_config = msgspec.convert(trainer_raw, trainer_cls.Config)
    except msgspec.ValidationError as exc:
        raise fail(exc, ".trainer") from None
    try:
        config = msgspec.convert({**raw, "trainer": {"kind": trainer_raw["kind"]}}, Config)
    except msgspec.ValidationError as exc:
        raise fail(exc) from None
    accumulate = config.loop.accumulate
    if config.run.steps % accumulate:
        raise ConfigError(
            f"{source}: `$.run.steps` = {config.run.steps} is not a multiple of "
            f"`loop.accumulate` = {accumulate}: a run ends at the end of a window"
            + _override_for("`$.run.steps`", overrides)
        )
    if accumulate > 1 and not trainer_cls.accumulates:
        raise ConfigError(
            f"{source}: `$.loop.accumulate` = {accumulate}: trainer {trainer_raw['kind']!r} "
            "applies an update every step and cannot accumulate windows"
            + _override_for("`$.loop.accumulate`", overrides)
        )
    return msgspec.structs.replace(config, trainer=trainer_config)


def _override_for(message: str, overrides: list[str] | tuple[str, ...]) -> str:
    """Name the override that caused a validation error, when one clearly did."""
    keys = [(override, override.split("=", 1)[0].strip()) for override in overrides]
    for override, key in keys:
        if f"`$.{key}`" in message:
            return f" (from override {override!r})"
    for override, key in keys:
        table, _, leaf = key.rpartition(".")
        # An error about a table (unknown field, a cross-field check) names the key.
        if table and f"`$.{table}`" in message and f"`{leaf}`" in message:
            return f" (from override {override!r})"
    return ""


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
    except tomllib.TOMLDecodeError:
        return text


def to_toml(config: Config) -> str:
    """The resolved config as TOML; unset optional values (None) are left out."""
    return msgspec.toml.encode(_without_none(msgspec.to_builtins(config))).decode()


def _without_none(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _without_none(v) for k, v in tree.items() if v is not None}
    return tree
