"""Test trainers: a tiny torch model whose every hook is recorded, with injectable
failures and delays per phase, and a fake engine child process.

Used in-process by the golden event-order tests and, through
``kind = "tests.support.fakes:FakeTrainer"``, by the real-signal subprocess tests.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import torch

import corun
from corun.execution.compute import cancel_point

Phase = Literal["", "setup", "rollout", "train", "sync", "eval", "save", "end"]


class FakeConfig(corun.TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    fail_in: Phase = ""  # raise FakeError in this phase
    fail_at_step: int = 1  # ... at this step (1-based train step; rollout index + 1)
    slow_in: Phase = ""  # sleep in this phase, in small cooperative slices
    slow_s: float = 0.0
    block_in: Phase = ""  # sleep in this phase in one blocking call (no cancel points),
    block_s: float = 0.0  # as a model load or an engine's build does
    micro_batches: int = 4  # loss calls per mini-batch, with cancel points between them
    spawn_engine: bool = False  # start a child process as the "rollout engine"
    teardown_fails: bool = False  # the weight-sync teardown step raises


# The documented teardown order (README), for a trainer that registers an engine and
# then a weight-sync channel, as FakeTrainer does; with [serve] enabled the endpoint
# stops right after the producers (DOCUMENTED_ORDER).
TEARDOWN_ORDER = [
    "teardown:stop",
    "teardown:save",
    "teardown:checkpoints",
    "teardown:weight_sync",
    "teardown:engine",
    "teardown:logging",
    "teardown:on_train_end",
]
DOCUMENTED_ORDER = [TEARDOWN_ORDER[0], "teardown:endpoint", *TEARDOWN_ORDER[1:]]


class FakeError(RuntimeError):
    pass


class CallLog(list[str]):
    """A list of hook calls that a test can await an entry of: hooks append from lane
    threads, so the waiting test task blocks on a ``threading.Event`` in a worker
    thread instead of polling."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._waiting: dict[str, threading.Event] = {}

    def append(self, call: str) -> None:
        with self._lock:
            super().append(call)
            event = self._waiting.get(call)
        if event is not None:
            event.set()

    async def reached(self, call: str) -> None:
        """Return once ``call`` has been appended (at once if it has been)."""
        with self._lock:
            if call in self:
                return
            event = self._waiting.setdefault(call, threading.Event())
        await anyio.to_thread.run_sync(event.wait, abandon_on_cancel=True)


class FakeTrainer(corun.Trainer[FakeConfig]):
    """Linear regression on random data; records hook calls in ``calls``."""

    Config = FakeConfig

    def __init__(self, config: corun.Config) -> None:
        super().__init__(config)
        self.calls = CallLog()
        self.phases = CallLog()  # each phase as it is entered
        self.engine: corun.ChildProcess | None = None

    # -- helpers
    def _phase(self, phase: Phase, step: int = -1) -> None:
        marker = self.run_config.run_dir / f"phase-{phase}"
        marker.touch()  # for a subprocess's watcher
        self.phases.append(phase)
        if self.config.slow_in == phase:
            until = time.monotonic() + self.config.slow_s
            while time.monotonic() < until:
                time.sleep(0.01)
                cancel_point()
        if self.config.block_in == phase:
            time.sleep(self.config.block_s)
        if self.config.fail_in == phase and step in (-1, self.config.fail_at_step):
            raise FakeError(f"injected failure in {phase}")

    # -- hooks
    def setup(self, ctx: corun.SetupContext) -> None:
        self.calls.append("setup")
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        ctx.add_optimizer(self.optimizer)
        self.engine_weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        if self.config.spawn_engine:
            self.engine = corun.ChildProcess([sys.executable, "-c", "import time; time.sleep(600)"])
            Path(self.run_config.run_dir / "engine.pid").write_text(str(self.engine.pid))
            ctx.on_teardown("engine", self.engine.stop)
        else:
            ctx.on_teardown("engine", lambda: self.calls.append("teardown:engine"))
        ctx.on_teardown("weight_sync", self._close_weight_sync)
        self._phase("setup")

    def _close_weight_sync(self) -> None:
        self.calls.append("teardown:weight_sync")
        if self.config.teardown_fails:
            raise FakeError("injected failure in weight-sync teardown")

    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> corun.Batch:
        self.calls.append(f"rollout:{ctx.index}")
        self._phase("rollout", ctx.index + 1)
        x = torch.randn(8, 4, generator=ctx.generator)
        y = x.sum(dim=1, keepdim=True)
        return corun.Batch((x, y), metrics={"rollout/reward_mean": float(y.mean())})

    def micro_batches(self, batch: corun.Batch) -> int:
        return self.config.micro_batches

    def loss(self, batch: corun.Batch, part: corun.Part) -> tuple[torch.Tensor, dict[str, float]]:
        if part.micro == 0 and part.mini == 0:
            self.calls.append(f"train:{batch.index}")
        self._phase("train", batch.index + 1)
        x, y = batch.data
        rows = part.rows(len(x))
        loss = torch.nn.functional.mse_loss(self.model(x[rows]), y[rows])
        return loss * part.share(len(x)), {}

    def sync_weights(self, version: int) -> None:
        self.calls.append(f"sync:{version}")
        self._phase("sync", version)
        self.engine_weights = {k: v.clone() for k, v in self.model.state_dict().items()}

    def evaluate_baseline(self) -> dict[str, float]:
        return self._evaluate(0)

    def evaluate_periodic(self, step: int) -> dict[str, float]:
        return self._evaluate(step)

    def _evaluate(self, step: int) -> dict[str, float]:
        self.calls.append("eval")
        self._phase("eval", step)
        with torch.no_grad():
            return {"eval/weight_norm": float(self.model.weight.norm())}

    def on_train_end(self, outcome: corun.Outcome) -> None:
        self.calls.append(f"on_train_end:{outcome.reason}")
        self._phase("end")

    def state_dict(self) -> dict[str, Any]:
        self._phase("save")
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
