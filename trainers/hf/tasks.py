"""Prompts of the Hugging Face path: a JSONL file (``data.path``) of plain prompts or
chat messages with reference answers, or the built-in task — short arithmetic word
problems made in code ("Ann has 12 apples and gets 7 more. How many apples now?" →
19; batches are pure functions of (seed, index)). One prompt in ten, by a stable
hash of its text, is held out for evaluation and never trained on."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Protocol

import msgspec

from corun import DataError, Dataset, ShuffledBatches, read_jsonl, stable_seed
from corun.base.config import DataConfig
from trainers.hf.prompts import Message, Prompt


@dataclass(frozen=True)
class Example:
    """A prompt and its reference answer ("" when the data has none); from a generated
    source (trainers/hf/reasoning_gym.py), the task it was drawn from and the item its
    scorer reads (the ``task_score`` reward)."""

    prompt: Prompt
    answer: str
    task: str = ""
    entry: object = field(default=None, compare=False)


class PromptRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of a prompt file: ``{"prompt": ..., "answer": ...}`` or
    ``{"messages": [{"role": ..., "content": ...}, ...], "answer": ...}``; checked while
    decoding, so errors name ``file:line``."""

    prompt: str = ""
    messages: Annotated[list[Message], msgspec.Meta(max_length=64)] = []
    answer: str = ""

    def __post_init__(self) -> None:
        if bool(self.prompt) == bool(self.messages):
            raise ValueError("give exactly one of a non-empty `prompt` or `messages`")
        if self.messages and self.messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: nothing left to reply to")

    def example(self) -> Example:
        return Example(Prompt(self.prompt, tuple(self.messages)), self.answer)


def read_prompts(path: str | Path) -> tuple[list[Example], list[Example]]:
    """A prompt file as (training examples, held-out examples)."""
    examples = [record.example() for record in read_jsonl(path, PromptRecord)]
    train = [e for e in examples if not held_out(str(e.prompt))]
    if not train:
        raise DataError(f"{path}: every record is held out for evaluation; add more")
    return train, [e for e in examples if held_out(str(e.prompt))]


def prompt_batches(
    path: str | Path, batch_size: int, seed: int, shuffle: bool
) -> ShuffledBatches[Example]:
    return ShuffledBatches(read_prompts(path)[0], batch_size, seed, shuffle)


NAMES = ("Ann", "Ben", "Cy", "Dee", "Eli", "Fay")
THINGS = ("apples", "books", "coins", "pens", "shells", "stamps")


@dataclass(frozen=True)
class Problem:
    """A prompt (the user's message) and the reference answer."""

    prompt: str
    answer: str


def problem(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(1, 9)
    if rng.random() < 0.5:
        text = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
        return Problem(text, str(a + b))
    a = max(a, b + 1)
    text = f"{name} has {a} {thing} and gives away {b}. How many {thing} now?"
    return Problem(text, str(a - b))


def held_out(prompt: str) -> bool:
    return stable_seed("held-out", prompt) % 10 == 0


def draw(rng: random.Random, want_held_out: bool) -> Example:
    """A word problem from ``rng``, redrawn until it is (not) a held-out one."""
    while True:
        item = problem(rng)
        if held_out(item.prompt) == want_held_out:
            return Example(Prompt(item.prompt), item.answer)


class WordProblems:
    """Training batches: batch ``i`` is a pure function of (seed, i, batch_size)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, batch_size: int, seed: int) -> None:
        self.batch_size, self.seed = batch_size, seed

    def batch(self, index: int) -> list[Example]:
        rng = random.Random(stable_seed("word-problems", self.seed, index))
        return [draw(rng, False) for _ in range(self.batch_size)]


def eval_problems(n: int) -> list[Example]:
    """The first ``n`` held-out word problems (never a training prompt), the same in
    every process."""
    rng = random.Random(stable_seed("word-problems-eval"))
    return [draw(rng, True) for _ in range(n)]


def corpus(n: int = 2000) -> list[str]:
    """Text to train the tiny model's tokenizer on: problems and answers as chats."""
    rng = random.Random(stable_seed("word-corpus"))
    return [chat_text(p.prompt, p.answer) for p in (problem(rng) for _ in range(n))]


def chat_text(prompt: object, answer: str) -> str:
    """A prompt and its answer in the tiny model's chat format, so that a tokenizer
    trained on such text makes whole tokens of its roles too."""
    return f"user: {prompt}\nassistant: {answer}\n"


class Generated(Protocol):
    """A generated data source (trainers/hf/reasoning_gym.py's ``TaskMix``): its items
    made from the run's seed, its held-out items and their scorer."""

    def batches(self, batch_size: int, seed: int) -> Dataset: ...

    def held_out(self, n: int) -> list[Example]: ...

    def score(self, response: str, entry: object) -> float: ...


def training_batches(data: DataConfig, seed: int, generated: Generated | None) -> Dataset:
    """The run's training data: the generated source, the prompt file or the word
    problems."""
    if generated is not None:
        return generated.batches(data.batch_size, seed)
    if data.path:
        return prompt_batches(data.path, data.batch_size, seed, data.shuffle)
    return WordProblems(data.batch_size, seed)


def held_out_examples(data: DataConfig, n: int, generated: Generated | None) -> list[Example]:
    """Up to ``n`` held-out examples of the same data, never trained on."""
    if generated is not None:
        return generated.held_out(n)
    if data.path:
        return read_prompts(data.path)[1][:n]
    return eval_problems(n)
