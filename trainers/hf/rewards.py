"""Reward functions chosen in config: ``[trainer.rewards]`` maps a name to its weight,
and a sample's reward is the weighted sum.

A name is a built-in (``exact_match``, ``numeric_match``, ``format``; ``task_score``,
the data source's own scorer, where the source has one: reasoning-gym's tasks) or
``"package.module:function"``. A function is called with keyword arguments
``prompt`` (the prompt as text), ``response`` (the decoded reply) and ``answer`` (the
data's reference, "" when it has none) — accept ``**kwargs`` for the ones you do not
use — and returns a number; it may be ``async def``. One that raises, or returns
something that is not a finite number, fails that sample (it is not trained on, and
the reason is logged once per function), never the run.

Each call has a deadline, ``run.reward_timeout_s``: a function that hangs (a judge that
never answers, a sandbox that never exits) fails the run with one line naming the
function and the sample's prompt. A plain function's calls run on a compute lane,
watched one by one (corun/contract/user_calls.py's ``CallDeadlines``); a hung one is
abandoned in its thread, which Python cannot stop. An ``async def`` one is cancelled at
its deadline, unless it blocks the event loop instead of awaiting: nothing cuts that.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corun import ConfigError
from corun.contract.user_calls import CallDeadlines, deadline, quoted

log = logging.getLogger(__name__)
RewardFn = Callable[..., "float | Awaitable[float]"]
# A data source's scorer: (the reply, the item the source made) -> score.
TaskScorer = Callable[[str, object], float]
TASK_SCORE = "task_score"
Run = Callable[[Callable[[], Any]], Awaitable[Any]]  # a lane's run: ``await run(fn)``
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SETTING = "run.reward_timeout_s"
Sample = dict[str, Any]  # a reward call's keywords (and the item, under ENTRY)
ENTRY = "entry"


def exact_match(*, response: str, answer: str, **_: Any) -> float:
    """1 when the reply is the answer, up to surrounding whitespace."""
    return float(response.strip() == answer.strip())


def numeric_match(*, response: str, answer: str, **_: Any) -> float:
    """1 when the last number in the reply equals the answer's number."""
    found = NUMBER.findall(response)
    try:
        return float(bool(found) and float(found[-1]) == float(answer))
    except ValueError:  # the reference is not a number
        return 0.0


def format_check(*, response: str, **_: Any) -> float:
    """1 when the reply is one number and nothing else (the answer format the built-in
    task trains)."""
    return float(NUMBER.fullmatch(response.strip()) is not None)


BUILT_INS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_check,
}


@dataclass(frozen=True)
class ScoredBy:
    """The ``task_score`` reward: the data source's scorer on the reply and the
    sample's item (the ``entry`` keyword, which only this reward is given)."""

    scorer: TaskScorer

    def __call__(self, *, response: str, entry: object, **_: Any) -> float:
        return self.scorer(response, entry)


def resolve(name: str, where: str, scorer: TaskScorer | None = None) -> RewardFn:
    """A built-in by name (``task_score`` when the data source gives its ``scorer``),
    or ``package.module:function``; a usage error otherwise."""
    if name in BUILT_INS:
        return BUILT_INS[name]
    if name == TASK_SCORE:
        if scorer is None:
            raise ConfigError(
                f"{where}: the data source's own scorer; this data has none "
                '(data.source = "reasoning-gym" has one)'
            )
        return ScoredBy(scorer)
    if ":" not in name:
        raise ConfigError(
            f"{where}: unknown reward {name!r}; built-ins: {', '.join(BUILT_INS)}, "
            f'{TASK_SCORE} (a data source\'s scorer), or give "package.module:function"'
        )
    module_name, _, attr = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:  # an import runs the user's module: any error is theirs
        raise ConfigError(f"{where}: cannot load reward {name!r} ({exc})") from None
    if not callable(target):
        raise ConfigError(f"{where}: reward {name!r} is not a function")
    return target  # type: ignore[no-any-return]


@dataclass
class Scores:
    rewards: list[float]  # the weighted sums; 0 for a failed sample
    ok: list[bool]  # False: a function failed on the sample
    by_function: dict[str, float]  # each function's mean over the samples it scored


class Rewards:
    """The configured functions with their weights."""

    def __init__(
        self, weights: Mapping[str, float], where: str, timeout_s: float,
        scorer: TaskScorer | None = None,
    ) -> None:  # fmt: skip
        """``scorer``: the data source's own (the ``task_score`` reward), if it has one."""
        if not weights:
            raise ConfigError(f"{where}: no reward functions")
        self.functions = [
            (name, resolve(name, f"{where}.{name}", scorer), w) for name, w in weights.items()
        ]
        self.timeout_s = timeout_s  # each call's deadline (run.reward_timeout_s)
        self._reported: set[str] = set()

    async def score(
        self, prompts: list[str], responses: list[str], answers: list[str], run: Run | None = None,
        entries: Sequence[object] | None = None,
    ) -> Scores:  # fmt: skip
        """Score every sample with every function; the plain functions together through
        ``run`` (a compute lane: user code may be slow), ``async def`` ones on the event
        loop; every call within its deadline. ``entries``: each sample's item from the
        data source (``Example.entry``), for ``task_score``."""
        items = [None] * len(prompts) if entries is None else entries
        samples: list[Sample] = [
            {"prompt": p, "response": r, "answer": a, ENTRY: e}
            for p, r, a, e in zip(prompts, responses, answers, items, strict=True)
        ]
        values = await self._plain_values(samples, run)
        for name, fn, _ in self.functions:
            if inspect.iscoroutinefunction(fn):
                values[name] = await self._async_values(name, fn, samples)
        rewards = [0.0] * len(samples)
        ok = [True] * len(samples)
        by_function: dict[str, float] = {}
        for name, _, weight in self.functions:
            scored = [v for v in values[name] if v is not None]
            by_function[name] = sum(scored) / len(scored) if scored else 0.0
            for i, value in enumerate(values[name]):
                if value is None:
                    ok[i] = False
                else:
                    rewards[i] += weight * value
        return Scores(
            [r if good else 0.0 for r, good in zip(rewards, ok, strict=True)], ok, by_function
        )

    async def _plain_values(
        self, samples: list[Sample], run: Run | None
    ) -> dict[str, list[float | None]]:
        """Each plain function on every sample, all in one lane call, each call watched."""
        plain = [(n, fn) for n, fn, _ in self.functions if not inspect.iscoroutinefunction(fn)]
        calls = CallDeadlines(self.timeout_s, SETTING, _what)

        def call_all() -> dict[str, list[float | None]]:
            return {
                name: [self._check(name, calls.call((name, s), _call, fn, s)) for s in samples]
                for name, fn in plain
            }

        return await calls.run(run, call_all) if plain else {}

    async def _async_values(
        self, name: str, fn: RewardFn, samples: list[Sample]
    ) -> list[float | None]:
        values = []
        for sample in samples:
            with deadline(_what((name, sample)), self.timeout_s, SETTING):
                outcome = await _settle(fn, sample)
            values.append(self._check(name, outcome))
        return values

    def _check(self, name: str, outcome: object) -> float | None:
        """A function's return value as a reward; None (reported once) when it failed."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            if isinstance(outcome, bool) or not isinstance(outcome, int | float):
                raise TypeError(f"returned {type(outcome).__name__}, not a number")
            if not math.isfinite(outcome):
                raise ValueError(f"returned {outcome}")
            return float(outcome)
        except Exception as exc:
            if name not in self._reported:
                self._reported.add(name)
                log.warning("reward %s failed on a sample (%s: %s); the sample is not trained "
                            "on (reported once)", name, type(exc).__name__, exc)  # fmt: skip
            return None


def _what(call: tuple[str, Sample]) -> str:
    """A call in the deadline's line: the function and the sample's prompt."""
    name, sample = call
    return f"reward function {name} for prompt {quoted(sample['prompt'])}"


def _arguments(fn: RewardFn, sample: Sample) -> Sample:
    """A function's keywords: prompt, response, answer; the item too for task_score
    (a user's function, written for those three, is never given a fourth)."""
    if isinstance(fn, ScoredBy):
        return sample
    return {key: value for key, value in sample.items() if key != ENTRY}


def _call(fn: RewardFn, sample: Sample) -> object:
    try:
        return fn(**_arguments(fn, sample))
    except Exception as exc:  # the user's function: its failure fails the sample only
        return exc


async def _settle(fn: RewardFn, sample: Sample) -> object:
    try:
        return await fn(**_arguments(fn, sample))  # type: ignore[misc]
    except Exception as exc:
        return exc
