"""Evaluation: the baseline before the first step (``loop.baseline_eval``, not after a
resume) and the periodic one when the cadence says (``loop.eval_interval``, and the
last step). Each runs the trainer's hook on the train lane and is recorded as span and
event ``baseline_eval`` or ``eval``, its metrics logged with ``perf/eval_time_s``.

Each is bounded by ``run.eval_timeout_s``: an evaluation that hangs (a stuck generate,
a remote judge that never answers) fails the run with one line instead of holding it
(corun/loop/deadlines.py; a hook stuck in a blocking call is abandoned on the lane).
"""

from __future__ import annotations

from typing import Any

from corun.base.config import Config
from corun.contract.trainer import Trainer
from corun.execution.compute import Lane, call_hook
from corun.loop.cadence import Cadence
from corun.loop.deadlines import deadline
from corun.loop.phases import Phases


class Evaluator:
    def __init__(self, trainer: Trainer[Any], config: Config, lane: Lane, phases: Phases) -> None:
        self.trainer = trainer
        self.cadence = Cadence.of(config)
        self.baseline_eval = config.loop.baseline_eval
        self.lane = lane
        self.phases = phases
        self.timeout_s = config.run.eval_timeout_s

    async def baseline(self, resumed: bool) -> None:
        if self.baseline_eval and not resumed:
            await self._evaluate(
                "baseline_eval", "the baseline evaluation", self.trainer.evaluate_baseline
            )

    async def after(self, step: int) -> None:
        """The evaluation after step ``step``, if the cadence has one there."""
        if self.cadence.evaluates(step):
            what = f"the evaluation after step {step}"
            await self._evaluate("eval", what, self.trainer.evaluate_periodic, step)

    async def _evaluate(self, name: str, what: str, hook: Any, *args: Any) -> None:
        with (
            self.phases.phase(name, "eval") as evaluation,
            deadline(what, self.timeout_s, "run.eval_timeout_s"),
        ):
            evaluation.metrics.update(await call_hook(self.lane, hook, *args))
