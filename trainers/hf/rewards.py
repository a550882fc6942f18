"""Reward functions chosen in config: ``[trainer.rewards]`` maps a name to its weight,
and a sample's reward is the weighted sum.

A name is a built-in (``exact_match``, ``numeric_match``, ``format``) or
``"package.module:function"``. A function is called with keyword arguments
``prompt`` (the prompt as text), ``response`` (the decoded reply) and ``answer`` (the
data's reference, "" when it has none) — accept ``**kwargs`` for the ones you do not
use — and returns a number; it may be ``async def``. One that raises, or returns
something that is not a finite number, fails that sample (it is not trained on, and
the reason is logged once per function), never the run.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from corun import ConfigError

log = logging.getLogger(__name__)
RewardFn = Callable[..., "float | Awaitable[float]"]
Run = Callable[[Callable[[], list["float | None"]]], Awaitable[list["float | None"]]]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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


def resolve(name: str, where: str) -> RewardFn:
    """A built-in by name, or ``package.module:function``; a usage error otherwise."""
    if name in BUILT_INS:
        return BUILT_INS[name]
    if ":" not in name:
        raise ConfigError(
            f"{where}: unknown reward {name!r}; built-ins: {', '.join(BUILT_INS)}, "
            'or give "package.module:function"'
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

    def __init__(self, weights: Mapping[str, float], where: str) -> None:
        if not weights:
            raise ConfigError(f"{where}: no reward functions")
        self.functions = [
            (name, resolve(name, f"{where}.{name}"), w) for name, w in weights.items()
        ]
        self._reported: set[str] = set()

    async def score(
        self, prompts: list[str], responses: list[str], answers: list[str], run: Run | None = None
    ) -> Scores:
        """Score every sample with every function; plain functions run through ``run``
        (a compute lane: user code may be slow), ``async def`` ones on the event loop."""
        samples = [
            {"prompt": p, "response": r, "answer": a}
            for p, r, a in zip(prompts, responses, answers, strict=True)
        ]
        rewards = [0.0] * len(samples)
        ok = [True] * len(samples)
        by_function: dict[str, float] = {}
        for name, fn, weight in self.functions:
            if inspect.iscoroutinefunction(fn):
                values = [self._check(name, await _settle(fn, s)) for s in samples]
            else:

                def call_all(name: str = name, fn: RewardFn = fn) -> list[float | None]:
                    return [self._check(name, _call(fn, s)) for s in samples]

                values = call_all() if run is None else await run(call_all)
            scored = [v for v in values if v is not None]
            by_function[name] = sum(scored) / len(scored) if scored else 0.0
            for i, value in enumerate(values):
                if value is None:
                    ok[i] = False
                else:
                    rewards[i] += weight * value
        return Scores(
            [r if good else 0.0 for r, good in zip(rewards, ok, strict=True)], ok, by_function
        )

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


def _call(fn: RewardFn, sample: dict[str, str]) -> object:
    try:
        return fn(**sample)
    except Exception as exc:  # the user's function: its failure fails the sample only
        return exc


async def _settle(fn: RewardFn, sample: dict[str, str]) -> object:
    try:
        return await fn(**sample)  # type: ignore[misc]
    except Exception as exc:
        return exc
