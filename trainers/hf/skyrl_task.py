"""A SkyRL-Gym text environment as the task of an hf agentic run
(``trainer.task = "skyrl-gym"``, the ``skyrl`` extra).

``[trainer.environment]`` names a registered SkyRL-Gym env (``env``, e.g.
``"gsm8k_multi_turn"``) with its ``env_config``, and the data: a JSONL file in SkyRL's
dataset format (``path``: rows of ``prompt`` messages, ``env_class``, ``reward_spec``
``{"ground_truth": ...}``, ``extra_info``), or, without one, corun's arithmetic word
problems written in GSM8K form ("Ann has 12 apples and gets 7 more. How many apples now?
Let's think step by step and output the final answer after "####"." → ground truth
"19"; trainers/hf/tasks.py's generator). Each episode runs on a fresh env built from its
row (corun/agents/skyrl.py): the row's prompt is the conversation's start, each reply's
text the env's action, its observations the next messages, its rewards the episode's.

Training batch ``i`` is a pure function of (run seed, i): the generator's batch ``i``,
or batch ``i`` of the file's rows shuffled by the seed, so a resume is exact. One row in
ten, by a stable hash of its prompt's text (trainers/hf/tasks.py's ``held_out``), is
held out for evaluation and never trained on. SkyRL envs take no seed: an env that
draws at random draws from its own state.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import msgspec

from corun import ConfigError, DataError, Dataset, ShuffledBatches, read_jsonl
from corun.agents.skyrl import SkyRLEnvironment, registered
from corun.contract.episodes import Episode
from corun.contract.policy import ChatMessage
from trainers.agentic.calculator import EnvSettings
from trainers.hf.chat_tasks import ChatTask
from trainers.hf.prompts import Message
from trainers.hf.tasks import Example, WordProblems, eval_problems, held_out

INSTALL = "pip install -e '.[skyrl]'"
# SkyRL's own GSM8K preprocessing appends this to each question.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

Row = dict[str, Any]  # one row of SkyRL's dataset format: an episode's task


class SkyRLSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[trainer.environment]`` of ``task = "skyrl-gym"``."""

    env: str = "gsm8k_multi_turn"  # a registered SkyRL-Gym env id
    env_config: dict[str, Any] = msgspec.field(default_factory=dict)  # the env's settings
    # A JSONL file of rows in SkyRL's dataset format; "" the built-in word problems.
    path: str = ""
    # Added to each built-in row's extra_info (gsm8k_multi_turn reads max_turns there).
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)
    # An episode succeeds when it ends with at least this reward (gsm8k_multi_turn adds
    # a small format score per wrong turn to the 1 of the right one).
    success_reward: Annotated[float, msgspec.Meta(gt=0)] = 1.0

    def __post_init__(self) -> None:
        known = sorted(package().envs.registration.registry)
        if self.env not in known:
            close = difflib.get_close_matches(self.env, known, n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ConfigError(
                f"`$.trainer.environment.env`: SkyRL-Gym has no env {self.env!r}{hint}; "
                f"registered: {', '.join(known)}"
            )


def package() -> ModuleType:
    """The skyrl_gym module; without it, a usage error saying how to install it."""
    try:
        import skyrl_gym
    except ImportError:
        raise ConfigError(f'`$.trainer.task` = "skyrl-gym" needs skyrl-gym: {INSTALL}') from None
    return skyrl_gym


class RowRecord(msgspec.Struct, frozen=True):
    """A line of a SkyRL dataset file, checked while decoding (errors name file:line);
    keys beyond these are not passed on."""

    prompt: Annotated[list[Message], msgspec.Meta(min_length=1)]
    env_class: str = ""
    reward_spec: dict[str, Any] = msgspec.field(default_factory=dict)
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)
    data_source: str = ""


def prompt_text(row: Mapping[str, Any]) -> str:
    """A row's prompt as one text: what the held-out hash reads."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in row["prompt"])


def read_rows(path: str | Path, env: str) -> tuple[list[Row], list[Row]]:
    """A SkyRL dataset file as (training rows, held-out rows); a row for another env
    than the run's is a DataError naming it."""
    rows: list[Row] = msgspec.to_builtins(read_jsonl(path, RowRecord))
    for line, row in enumerate(rows, 1):
        if row["env_class"] not in ("", env):
            raise DataError(f"{path}:{line}: env_class {row['env_class']!r}; the run's is {env!r}")
    train = [row for row in rows if not held_out(prompt_text(row))]
    if not train:
        raise DataError(f"{path}: every row is held out for evaluation; add more")
    return train, [row for row in rows if held_out(prompt_text(row))]


def gsm8k_row(example: Example, env: str, extra_info: Mapping[str, Any]) -> Row:
    """A word problem as SkyRL's GSM8K preprocessing writes a row."""
    return {
        "data_source": "corun/word-problems",
        "prompt": [{"role": "user", "content": f"{example.prompt} {INSTRUCTION}"}],
        "env_class": env,
        "reward_spec": {"method": "rule", "ground_truth": example.answer},
        "extra_info": {"answer": f"#### {example.answer}", **extra_info},
    }


class GSM8KWordProblems:
    """The built-in rows: batch ``i`` is the word problems' batch ``i`` of the seed."""

    in_memory = True  # computed from memory: fetched without a deadline

    def __init__(self, problems: WordProblems, row: Callable[[Example], Row]) -> None:
        self.problems, self.row = problems, row

    def batch(self, index: int) -> list[Row]:
        return [self.row(example) for example in self.problems.batch(index)]


class SkyRLTask(ChatTask):
    """Episodes of one SkyRL-Gym env on the rows of a dataset."""

    Settings = SkyRLSettings
    settings: SkyRLSettings

    def __init__(self, settings: SkyRLSettings, seed: int, system_prompt: str) -> None:
        super().__init__(settings, seed, system_prompt)
        self.make = registered(settings.env, settings.env_config)
        self.rows = read_rows(settings.path, settings.env) if settings.path else None

    def dataset(self, batch_size: int) -> Dataset:
        if self.rows is None:
            return GSM8KWordProblems(WordProblems(batch_size, self.seed), self._word_row)
        return ShuffledBatches([self._with_system(r) for r in self.rows[0]], batch_size,
                               self.seed, shuffle=True)  # fmt: skip

    def eval_tasks(self, n: int) -> Sequence[Row]:
        if self.rows is None:
            return [self._word_row(example) for example in eval_problems(n)]
        return [self._with_system(row) for row in self.rows[1][:n]]

    def make_env(self, index: int, row: int, settings: EnvSettings) -> SkyRLEnvironment:
        return SkyRLEnvironment(self.make)

    def success(self, episode: Episode) -> bool:
        return episode.status == "done" and episode.reward >= self.settings.success_reward

    def demonstration(self, task: Row) -> list[ChatMessage]:
        """The ideal episode: the prompt, then the ground truth after "####" (GSM8K's
        answer format) in one reply."""
        answer = f"#### {task['reward_spec']['ground_truth']}"
        prompt = msgspec.convert(task["prompt"], list[ChatMessage])
        return [*prompt, ChatMessage(role="assistant", content=answer)]

    def _word_row(self, example: Example) -> Row:
        return self._with_system(gsm8k_row(example, self.settings.env, self.settings.extra_info))

    def _with_system(self, row: Row) -> Row:
        if not self.system_prompt:
            return row
        system = {"role": "system", "content": self.system_prompt}
        return {**row, "prompt": [system, *row["prompt"]]}
