"""corun: one async loop template for RL post-training trainers.

The public API: a trainer subclasses :class:`Trainer` (its rollout and its loss);
:func:`run` trains it under structured concurrency (asyncio or trio); ``corun train
config.toml`` does the same from a terminal with signals and exit codes.
"""

from corun.compute import Lane, cancel_point
from corun.config import Config, TrainerConfig
from corun.config_file import config_from_dict, load_config
from corun.data import Dataset, ShuffledBatches, read_jsonl
from corun.distributed import World, shared_count, shared_mean_std, world
from corun.embed import training
from corun.episodes import Environment, Episode, EpisodeInbox, Step
from corun.errors import CheckpointError, ConfigError, DataError, UsageError
from corun.loop import run
from corun.procs import ChildProcess
from corun.registry import resolve_trainer
from corun.rng import generator, rollout_generator, seed_everything, stable_seed, update_generator
from corun.session import Session
from corun.teardown import RunControl
from corun.trainer import (
    Batch,
    Image,
    Metrics,
    OptimizerSpec,
    Outcome,
    Part,
    RolloutContext,
    SetupContext,
    Trainer,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "CheckpointError",
    "ChildProcess",
    "Config",
    "ConfigError",
    "DataError",
    "Dataset",
    "Environment",
    "Episode",
    "EpisodeInbox",
    "Image",
    "Lane",
    "Metrics",
    "OptimizerSpec",
    "Outcome",
    "Part",
    "RolloutContext",
    "RunControl",
    "Session",
    "SetupContext",
    "ShuffledBatches",
    "Step",
    "Trainer",
    "TrainerConfig",
    "UsageError",
    "World",
    "cancel_point",
    "config_from_dict",
    "generator",
    "load_config",
    "read_jsonl",
    "resolve_trainer",
    "rollout_generator",
    "run",
    "seed_everything",
    "shared_count",
    "shared_mean_std",
    "stable_seed",
    "training",
    "update_generator",
    "world",
]
