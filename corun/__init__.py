"""corun: one async loop template for RL post-training trainers.

The public API: a trainer subclasses :class:`Trainer`; :func:`run` trains it under
structured concurrency (asyncio or trio); ``corun train config.toml`` does the same
from a terminal with signals and exit codes.
"""

from corun.checkpoint import seed_everything
from corun.compute import Lane, cancel_point
from corun.config import Config, TrainerConfig, config_from_dict, load_config
from corun.data import Dataset, ShuffledBatches, read_jsonl
from corun.errors import CheckpointError, ConfigError, DataError, UsageError
from corun.loop import run
from corun.procs import ChildProcess
from corun.teardown import RunControl
from corun.trainer import (
    Batch,
    Image,
    Metrics,
    Outcome,
    SetupContext,
    Trainer,
    resolve_trainer,
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
    "Image",
    "Lane",
    "Metrics",
    "Outcome",
    "RunControl",
    "SetupContext",
    "ShuffledBatches",
    "Trainer",
    "TrainerConfig",
    "UsageError",
    "cancel_point",
    "config_from_dict",
    "load_config",
    "read_jsonl",
    "resolve_trainer",
    "run",
    "seed_everything",
]
