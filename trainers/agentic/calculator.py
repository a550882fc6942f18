"""The built-in tool task: sums of two 3-digit numbers, with a calculator tool.

TinyLM adds 3-digit numbers badly from its weights alone; with the tool it only has
to copy. An episode needs at least two turns: the policy writes a call such as
``(123+456)``, the calculator answers ``=579``, and the policy writes ``579`` as its
final answer. A reply that starts with ``(`` but is no well-formed call gets the
error observation ``!`` and the episode goes on; any other reply is the final answer,
scored 1 when exact and 0.5 × the share of digits in place otherwise (partial credit
gives RL a gradient early). Every turn ends with EOS.

Each tool call waits ``latency_ms`` (simulated I/O on the event loop; with
``tail_prob`` a call takes ``tail_factor`` times as long), so the cost of waiting on
tools is a setting.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Annotated

import anyio
import msgspec

from corun import stable_seed
from corun.contract.episodes import Step
from trainers.lm.vocab import EOS as EOS
from trainers.lm.vocab import PAD as PAD
from trainers.lm.vocab import CharVocab

# ----------------------------------------------------------------------------- tokens

CHARS = "0123456789+=()!"
VOCABULARY = CharVocab(CHARS)
VOCAB_SIZE = len(VOCABULARY)
MAX_LEN = 48  # prompt 8 + three turns of up to 10 tokens + two observations of 5
PROMPT_LEN = 8  # "123+456="
OBSERVATION_LEN = 5  # "=1579", right-padded with PAD: a fixed width for every episode
encode = VOCABULARY.encode
decode = VOCABULARY.decode


def encode_observation(text: str) -> list[int]:
    """An observation at its fixed width (PAD after it), the same in demonstrations,
    rollouts and evaluation."""
    ids = encode(text)[:OBSERVATION_LEN]
    return ids + [PAD] * (OBSERVATION_LEN - len(ids))


# ----------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def held_out(self) -> bool:
        """One problem in ten, by a stable hash: never trained on."""
        return stable_seed("calculator-split", self.a, self.b) % 10 == 0


def _problem(rng: random.Random, held_out: bool) -> Problem:
    while True:
        problem = Problem(rng.randint(100, 999), rng.randint(100, 999))
        if problem.held_out() == held_out:
            return problem


class Problems:
    """Training batches: batch ``i`` is a pure function of (seed, i, batch_size)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, batch_size: int, seed: int) -> None:
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, index: int) -> list[Problem]:
        rng = random.Random(stable_seed("calculator", self.seed, index))
        return [_problem(rng, held_out=False) for _ in range(self.batch_size)]


def eval_problems(n: int) -> list[Problem]:
    rng = random.Random(stable_seed("calculator-eval"))
    return [_problem(rng, held_out=True) for _ in range(n)]


def demonstration(problem: Problem) -> list[tuple[str, str]]:
    """The ideal episode: (reply, observation after it) per turn."""
    call = f"({problem.a}+{problem.b})"
    return [(call, f"={problem.answer}"), (problem.answer, "")]


# ----------------------------------------------------------------------------- the tool

CALL = re.compile(r"\((\d{1,4})\+(\d{1,4})\)")  # a well-formed tool call


def answer_reward(answer: str, response: str) -> float:
    if response == answer:
        return 1.0
    right = sum(a == r for a, r in zip(answer, response, strict=False))
    return 0.5 * right / len(answer)


class EnvSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.env]``: the cost of waiting on tools, and the limits of an episode."""

    # Wait per tool call (simulated I/O; 0: none). With probability tail_prob a call
    # takes tail_factor times as long (a long tail, as real tools and APIs have).
    latency_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    tail_prob: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    tail_factor: Annotated[float, msgspec.Meta(ge=1)] = 10.0
    # An environment step that takes longer ends its episode (status "timeout").
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # Policy turns per episode, and tokens per turn (EOS included).
    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 3
    turn_tokens: Annotated[int, msgspec.Meta(ge=2, le=16)] = 10


class CalculatorEnv:
    """One episode's environment: the problem, and a calculator behind a latency."""

    def __init__(self, settings: EnvSettings, seed: int) -> None:
        self.settings = settings
        self._latency = random.Random(seed)  # timing only: never reaches the numbers
        self.problem: Problem | None = None

    async def reset(self, task: Problem) -> str:
        self.problem = task
        return task.prompt

    async def step(self, reply: str) -> Step:
        assert self.problem is not None, "reset() first"
        if not reply.startswith("("):
            return Step("", answer_reward(self.problem.answer, reply), done=True)
        await self._wait()
        call = CALL.fullmatch(reply)
        if call is None:
            return Step("!", tool_call=True, tool_error=True)
        return Step(f"={int(call[1]) + int(call[2])}", tool_call=True)

    async def _wait(self) -> None:
        settings = self.settings
        latency = settings.latency_ms / 1000
        if latency and self._latency.random() < settings.tail_prob:
            latency *= settings.tail_factor
        if latency:
            await anyio.sleep(latency)
