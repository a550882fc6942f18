"""Run configs for in-process runs in a test's tmp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import corun


def make_config(run_dir: Path, trainer: dict[str, Any], **sections: dict[str, Any]) -> corun.Config:
    """A config for an in-process run: progress off, wandb off, run.dir = ``run_dir``."""
    raw: dict[str, Any] = {
        "run": {"dir": str(run_dir), **sections.pop("run", {})},
        "log": {"progress": "off", **sections.pop("log", {})},
        "trainer": trainer,
        **sections,
    }
    return corun.config_from_dict(raw)
