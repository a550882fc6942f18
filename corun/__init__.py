"""corun: one async loop template for RL post-training trainers.

The public API: a trainer subclasses :class:`Trainer` (its rollout and its loss);
:func:`run` trains it under structured concurrency (asyncio or trio); ``corun train
config.toml`` does the same from a terminal with signals and exit codes.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# torch's OpenMP threads sleep at barriers instead of spinning, unless the user chose:
# a spinning thread team beside another busy process waits for its descheduled member
# at every op, and corun keeps its thread count fixed (reproducible weights) rather
# than shrinking it (corun/execution/cores.py). Read by OpenMP when torch loads: this
# takes effect when corun is imported first, as the `corun` command does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Where each public name lives. Imported on first use (PEP 562): ``import corun``
# stays light, so the command's own signal handling is in place before torch loads
# (corun/host/entry.py).
_EXPORTS = {
    "corun.execution.compute": ["Lane", "cancel_point"],
    "corun.base.config": ["Config", "TrainerConfig"],
    "corun.contract.config_file": ["config_from_dict", "load_config"],
    "corun.contract.data": ["Dataset", "ShuffledBatches", "read_jsonl"],
    "corun.execution.distributed": ["World", "shared_count", "shared_mean_std", "world"],
    "corun.host.embed": ["training"],
    "corun.contract.episodes": ["Environment", "Episode", "EpisodeInbox", "Step"],
    "corun.base.errors": ["CheckpointError", "ConfigError", "DataError", "UsageError"],
    "corun.host.runs": ["run"],
    "corun.execution.procs": ["ChildProcess"],
    "corun.contract.registry": ["resolve_trainer"],
    "corun.base.rng": [
        "generator", "rollout_generator", "seed_everything", "stable_seed", "update_generator",
    ],
    "corun.loop.session": ["Session"],
    "corun.loop.teardown": ["RunControl"],
    "corun.contract.trainer": [
        "Batch", "Image", "Metrics", "OptimizerSpec", "Outcome", "Part", "RolloutContext",
        "Rows", "SetupContext", "Trainer",
    ],
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from corun.base.config import Config, TrainerConfig
    from corun.base.errors import CheckpointError, ConfigError, DataError, UsageError
    from corun.base.rng import (
        generator,
        rollout_generator,
        seed_everything,
        stable_seed,
        update_generator,
    )
    from corun.contract.config_file import config_from_dict, load_config
    from corun.contract.data import Dataset, ShuffledBatches, read_jsonl
    from corun.contract.episodes import Environment, Episode, EpisodeInbox, Step
    from corun.contract.registry import resolve_trainer
    from corun.contract.trainer import (
        Batch,
        Image,
        Metrics,
        OptimizerSpec,
        Outcome,
        Part,
        RolloutContext,
        Rows,
        SetupContext,
        Trainer,
    )
    from corun.execution.compute import Lane, cancel_point
    from corun.execution.distributed import World, shared_count, shared_mean_std, world
    from corun.execution.procs import ChildProcess
    from corun.host.embed import training
    from corun.host.runs import run
    from corun.loop.session import Session
    from corun.loop.teardown import RunControl

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
    "Rows",
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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'corun' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])
