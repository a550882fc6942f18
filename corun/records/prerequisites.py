"""Runs that feed other runs: train a prerequisite config first, reuse it after.

A trainer that starts from another run's checkpoint (GRPO from SFT, Flow-GRPO from
a pretrained flow model) names that run's config in ``Trainer.prerequisites()``.
Before set-up, the runtime trains each prerequisite to its full ``run.steps``, or
resumes it if it was interrupted, and reuses it when it is already complete. A
trainer then finds the checkpoint with :func:`checkpoint_for`.
"""

from __future__ import annotations

from pathlib import Path

from corun.base.config import Config
from corun.base.errors import CheckpointError
from corun.contract.config_file import load_config
from corun.records import checkpoint


def final_checkpoint(config: Config) -> Path | None:
    """The checkpoint at the end of ``config``'s run, if the run is complete."""
    found = checkpoint.list_checkpoints(config.run_dir)
    if found and found[-1][0] >= config.run.steps:
        return found[-1][1]
    return None


def checkpoint_for(init_from: str | Path) -> Path:
    """A checkpoint directory, given either one or the config of a completed run."""
    path = Path(init_from)
    if path.suffix == ".toml":
        config = load_config(path)
        done = final_checkpoint(config)
        if done is None:
            raise CheckpointError(
                f"{path}: run {config.run_dir} is not complete; list it in prerequisites()"
            )
        return done
    if not (path / checkpoint.STATE_FILE).is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory or a .toml config")
    return path


def is_config(init_from: str | Path) -> bool:
    return Path(init_from).suffix == ".toml"
