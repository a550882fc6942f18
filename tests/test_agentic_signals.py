"""Ctrl-C to a real ``corun train`` while its episodes wait on their tools: the run
stops within the wait (the waits are cancelled, not sat out), tears down in the
documented order and exits 130; its latest checkpoint loads."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from corun.contract.episodes import Environment, Step
from tests.support.corun_process import CorunRun, assert_interrupted, assert_latest_checkpoint_loads
from tests.test_agentic import TINY
from trainers.agentic.calculator import EnvSettings
from trainers.agentic.rl import AgenticGRPOTrainer

pytestmark = pytest.mark.slow


class StalledEnv:
    """Every step is a tool call that marks ``<run dir>/phase-tool`` and waits a minute."""

    def __init__(self, inner: Environment, marker: Path) -> None:
        self.inner, self.marker = inner, marker

    async def reset(self, task: Any) -> str:
        return await self.inner.reset(task)

    async def step(self, reply: str) -> Step:
        self.marker.touch()
        await anyio.sleep(60)
        return Step("!", tool_call=True, tool_error=True)


class StalledAgentic(AgenticGRPOTrainer):
    def make_env(self, index: int, row: int, settings: EnvSettings) -> Environment:
        env = super().make_env(index, row, settings)
        if index < 0:  # evaluation
            return env
        return StalledEnv(env, self.run_config.run_dir / "phase-tool")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigint_with_episodes_mid_tool_call(start_corun: Any, backend: str) -> None:
    run: CorunRun = start_corun(
        {**TINY, "kind": "tests.test_agentic_signals:StalledAgentic"},
        run={"steps": 4, "backend": backend}, loop={"baseline_eval": False},
        data={"batch_size": 2},
    )  # fmt: skip
    run.wait_phase("tool")
    sent = time.monotonic()
    run.send(signal.SIGINT)
    code = run.wait_exit()
    assert time.monotonic() - sent < 20  # not the 60 s the tools would have taken
    events = assert_interrupted(run, code, signal.SIGINT, complete=False)
    names = [e["event"] for e in events]
    # Set-up had finished: every step the runtime registers ran, in order.
    assert [n for n in names if n.startswith("teardown:")] == [
        "teardown:stop", "teardown:save", "teardown:checkpoints", "teardown:logging",
        "teardown:on_train_end",
    ]  # fmt: skip
    assert_latest_checkpoint_loads(run, expect_step=None)
