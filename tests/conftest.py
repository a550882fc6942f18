"""Shared test set-up: wandb off, one torch thread, both anyio backends, and the shared
fixtures of tests/support (loaded as plugins, so a test names a fixture without
importing it)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"
# The same for the corun processes tests start (they inherit it): a run's lanes keep the
# machine's cores fixed for the run (corun/execution/cores.py), and CI's 2 cores are
# shared by the test process, servers and their clients. A test of the default thread
# count (test_cores.py) starts its runs without it.
os.environ["OMP_NUM_THREADS"] = "1"
# The helpers' own asserts report their operands too, as a test's do.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = [
    "tests.support.cli",  # restore_process_state
    "tests.support.corun_process",  # start_corun
    "tests.support.hf_agents",  # tool_model
    "tests.support.vllm_fixtures",  # model_dir, chat, policy
]


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: several seconds (subprocesses, deadlines); runs in CI, never skipped"
    )
    config.addinivalue_line(
        "markers",
        "long: minutes, and what it covers also runs in a shorter test; left out by default "
        "(pyproject's addopts), run with `python -m pytest -m long`",
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fuzz tests' example counts per input kind (tests/support/fuzz_support.py)."""
    fuzz = sys.modules.get("tests.support.fuzz_support")
    counts = getattr(fuzz, "COUNTS", None)
    if counts:
        terminalreporter.write_sep("-", f"fuzz examples: {sum(counts.values())}")
        for kind, n in sorted(counts.items()):
            terminalreporter.write_line(f"{kind:<28} {n:>6}")
