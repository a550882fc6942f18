"""reasoning-gym's procedural tasks as a data source (``data.source = "reasoning-gym"``,
the ``reasoning-gym`` extra): ``[data.tasks.<name>]`` names each task with its weight and
its own settings (passed to ``reasoning_gym.create_dataset``).

Every item is made from the run's seed and its place: row ``r`` of batch ``i`` draws its
task by weight and its item's seed from an RNG seeded by (seed, i, r), so a batch is a
pure function of (seed, i, batch_size) and a resume is exact. Held-out items come from
a stream of their own (the same in every run, so a warm start and the run after it
evaluate on the same items), and the split is by content too: an item whose question
text the stable hash holds out (tasks.py's ``held_out``) is never trained on, and only
such items are evaluated. A reply is scored by its task's own ``score_answer`` (the
``task_score`` reward), on the text inside ``<answer>...</answer>`` when the reply has
one, else the whole reply.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from corun import ConfigError, stable_seed
from corun.base.config import DataConfig, TaskConfig
from trainers.hf.prompts import Prompt
from trainers.hf.tasks import Example, chat_text, held_out

SOURCE = "reasoning-gym"
INSTALL = "pip install -e '.[reasoning-gym]'"
# A held-out item is one in ten by content: draws past this many mean the task's
# questions (almost) never hash into the wanted half.
MAX_DRAWS = 1000


@dataclass(frozen=True)
class Item:
    """What a task's scorer needs: the task and its item (question, answer, metadata)."""

    task: str
    entry: Mapping[str, Any]


def package() -> ModuleType:
    """The reasoning_gym module; without it, a usage error saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            f'`$.data.source` = "{SOURCE}" needs the reasoning-gym package: {INSTALL}'
        ) from None
    return reasoning_gym


def source(data: DataConfig) -> TaskMix | None:
    """The configured reasoning-gym tasks, checked; None for another data source."""
    return TaskMix(data.tasks) if data.source == SOURCE else None


def unknown_task(name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=5)
    hint = f"; close: {', '.join(close)}" if close else "; reasoning_gym.factory.DATASETS lists all"
    return ConfigError(f"`$.data.tasks.{name}`: reasoning-gym has no task {name!r}{hint}")


class TaskMix:
    """The tasks with their weights and settings: items by seed, and their scorers."""

    def __init__(self, tasks: Mapping[str, TaskConfig]) -> None:
        rg = package()
        known = sorted(rg.factory.DATASETS)
        for name in tasks:
            if name not in known:
                raise unknown_task(name, known)
        self.create = rg.create_dataset
        self.names = list(tasks)
        self.weights = [task.weight for task in tasks.values()]
        self.settings = {name: dict(task.settings) for name, task in tasks.items()}
        # One dataset per task for scoring (score_answer reads the settings, not the
        # seed); made now, so bad settings fail the start, not the first batch.
        self.scorers = {name: self.dataset(name, 0) for name in self.names}

    def dataset(self, task: str, seed: int) -> Any:
        """The task's one-item dataset at ``seed`` (cheaper than indexing a big one:
        some tasks make every item of a dataset when it is created)."""
        try:
            return self.create(task, size=1, seed=seed, **self.settings[task])
        except Exception as exc:  # the settings are the user's: any error is theirs
            raise ConfigError(
                f"`$.data.tasks.{task}.settings`: reasoning-gym refused them "
                f"({type(exc).__name__}: {exc})"
            ) from None

    def draw(self, rng: random.Random, want_held_out: bool) -> Example:
        """A task by weight and an item of it, redrawn until it is on the wanted side of
        the held-out split (by its question text)."""
        for _ in range(MAX_DRAWS):
            task = rng.choices(self.names, self.weights)[0]
            # 32 bits: some tasks seed numpy's legacy RNG, which takes no more.
            entry = self.dataset(task, rng.getrandbits(32))[0]
            if held_out(entry["question"]) == want_held_out:
                item = Item(task, entry)
                return Example(Prompt(entry["question"]), str(entry["answer"]), task, item)
        raise ConfigError(
            f"`$.data.tasks`: no {'held-out' if want_held_out else 'training'} item in "
            f"{MAX_DRAWS} draws; the tasks' settings leave too few distinct questions"
        )

    def batches(self, batch_size: int, seed: int) -> TaskBatches:
        return TaskBatches(self, batch_size, seed)

    def held_out(self, n: int) -> list[Example]:
        """The first ``n`` held-out items, the same in every process and run."""
        rng = random.Random(stable_seed("reasoning-gym-eval", *self.names))
        return [self.draw(rng, True) for _ in range(n)]

    def score(self, response: str, entry: object) -> float:
        """The task's own score of a reply (its ``<answer>`` part when tagged)."""
        if not isinstance(entry, Item):
            raise TypeError("task_score needs the item a reasoning-gym source made")
        tagged = extract_answer(response)
        answer = response.strip() if tagged is None else tagged
        return float(self.scorers[entry.task].score_answer(answer=answer, entry=entry.entry))


def extract_answer(response: str) -> str | None:
    """The text of the reply's last ``<answer>`` tag; None when it has none."""
    from reasoning_gym.utils import extract_answer as extract

    found: str | None = extract(response)
    return found


class TaskBatches:
    """Training batches: batch ``i`` is a pure function of (seed, i, batch_size)."""

    in_memory = True  # made from memory in microseconds: fetched without a deadline

    def __init__(self, mix: TaskMix, batch_size: int, seed: int) -> None:
        self.mix, self.batch_size, self.seed = mix, batch_size, seed

    def batch(self, index: int) -> list[Example]:
        return [self.row(index, row) for row in range(self.batch_size)]

    def row(self, index: int, row: int) -> Example:
        rng = random.Random(stable_seed(SOURCE, self.seed, index, row))
        return self.mix.draw(rng, False)


# The tasks of configs/rg_sft.toml and rg_grpo.toml, small enough for the tiny model's
# 256 positions and a few-token reply; the built-in "tiny-llama-rg" tokenizer is
# trained on their text (tests/test_reasoning_gym.py checks the recipes name these).
ARITHMETIC: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
}


def corpus(n: int = 2000) -> list[str]:
    """Text to train the "tiny-llama-rg" tokenizer on: training items of
    :data:`ARITHMETIC` with their answers, as chats."""
    mix = TaskMix({name: TaskConfig(settings=s) for name, s in ARITHMETIC.items()})
    rng = random.Random(stable_seed("reasoning-gym-corpus"))
    return [chat_text(e.prompt, e.answer) for e in (mix.draw(rng, False) for _ in range(n))]
