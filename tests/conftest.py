"""Shared test set-up: wandb off, both anyio backends, run configs in tmp dirs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"

import corun


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Two intra-op threads on a shared 2-core machine contend with any other work and
    make these small models' steps up to 30x slower; one thread keeps tests fast."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_config(run_dir: Path, trainer: dict[str, Any], **sections: dict[str, Any]) -> corun.Config:
    """A config for an in-process run: progress off, wandb off, run.dir = ``run_dir``."""
    raw: dict[str, Any] = {
        "run": {"dir": str(run_dir), **sections.pop("run", {})},
        "log": {"progress": "off", **sections.pop("log", {})},
        "trainer": trainer,
        **sections,
    }
    return corun.config_from_dict(raw)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: several seconds (subprocesses, deadlines); runs in CI, never skipped"
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fuzz tests' example counts per input kind (tests/fuzz_support.py)."""
    fuzz = sys.modules.get("tests.fuzz_support")
    counts = getattr(fuzz, "COUNTS", None)
    if counts:
        terminalreporter.write_sep("-", f"fuzz examples: {sum(counts.values())}")
        for kind, n in sorted(counts.items()):
            terminalreporter.write_line(f"{kind:<28} {n:>6}")
