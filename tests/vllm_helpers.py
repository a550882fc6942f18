"""For the vLLM tests (tests/test_vllm*.py): a test-only HF GRPO trainer, loaded by
``corun train`` as ``kind = "tests.vllm_helpers:HeldGRPOTrainer"``, and checks that a
run's processes are gone.

It wraps the real engine, which ``HFGRPOTrainer.setup`` started: entering ``generate``
or ``update_weights`` touches ``<run dir>/phase-generate`` / ``phase-sync`` (the
markers tests/corun_process.py waits for), and with ``hold_in`` naming that phase the
call keeps the real engine busy until it is cancelled — generation repeats a long
decode (64 tokens, no stop), a weight update repeats the real reload — so a signal
lands inside vLLM's work, not in a sleep of the test's own.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import anyio
import pytest
from torch import Tensor

from corun import SetupContext
from corun.contract.engine import Engine, EngineWrapper, Generation, Sampling
from trainers.hf.rl import HFGRPOConfig, HFGRPOTrainer

Held = Literal["", "generate", "sync"]


class HeldGRPOConfig(HFGRPOConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    hold_in: Held = ""  # keep the engine busy in this phase until cancelled


class HeldEngine(EngineWrapper):
    """An :class:`Engine` that marks (and optionally holds) its phases."""

    def __init__(self, inner: Engine, run_dir: Path, hold_in: Held) -> None:
        super().__init__(inner)
        self.run_dir, self.hold_in = run_dir, hold_in

    async def _phase(self, phase: str) -> None:
        await anyio.Path(self.run_dir / f"phase-{phase}").touch()

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        await self._phase("generate")
        if self.hold_in == "generate":
            long = dataclasses.replace(sampling, max_tokens=64, stop_ids=())
            while True:  # in vLLM's decode steps until cancelled
                await self.inner.generate(prompts, long, seed)
        return await self.inner.generate(prompts, sampling, seed)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        await self._phase("sync")
        while self.hold_in == "sync":  # reloading until cancelled
            await self.inner.update_weights(state, version)
        await self.inner.update_weights(state, version)


class HeldGRPOTrainer(HFGRPOTrainer):
    Config = HeldGRPOConfig

    async def setup(self, ctx: SetupContext) -> None:  # type: ignore[override]
        await super().setup(ctx)  # the real engine started, its shutdown registered
        self.engine = HeldEngine(self.engine, self.run_config.run_dir, self.config.hold_in)


# ---------------------------------------------------------------- processes


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [child for child, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def assert_gone(pids: Sequence[int], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if running(pid)]
    assert not left, f"{what}: processes {left} outlived it"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """``os.killpg(pgid, 0)`` raises ProcessLookupError: nothing of the group is left
    (zombies included: their parent must have reaped them)."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
