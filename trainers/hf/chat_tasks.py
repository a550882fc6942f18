"""Where an hf agentic run's episodes come from: ``trainer.task`` names a chat task,
``[trainer.environment]`` holds its settings.

A chat task is the tasks of a run (its dataset and held-out set) and the environment
that plays each episode of one: the built-in calculator (trainers/hf/tools.py), an
OpenEnv environment served over HTTP (trainers/hf/openenv_task.py), a SkyRL-Gym text
environment (trainers/hf/skyrl_task.py), or a verifiers environment whose rollouts run
in a process of their own against the run's endpoint (trainers/hf/verifiers_task.py).
Each names its own settings struct; ``[trainer.environment]`` is converted to it when
the config is read, so a bad key exits 2 naming ``$.trainer.environment.<key>``.

The modules are imported by name, on use: a task's library (openenv, skyrl_gym) is
needed only by a run that names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from corun import Dataset, SetupContext, ShuffledBatches
from corun.agents.chat_runner import ChatEnvironment
from corun.contract.episodes import Episode, EpisodeInbox
from corun.contract.policy import ChatMessage, ToolSpec
from trainers.agentic.calculator import EnvSettings

# trainer.task -> "module:class" of its ChatTask.
TASKS: dict[str, str] = {
    "calculator": "trainers.hf.tools:CalculatorTask",
    "openenv": "trainers.hf.openenv_task:OpenEnvTask",
    "skyrl-gym": "trainers.hf.skyrl_task:SkyRLTask",
    "verifiers": "trainers.hf.verifiers_task:VerifiersTask",
}


class NoSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A task with nothing to set: ``[trainer.environment]`` stays empty."""


class ChatTask:
    """The tasks of an hf agentic run and the environment of each episode.

    Built on the train lane while the trainer sets up (blocking work allowed), then
    ``start``ed on the event loop: a task that runs a server or a process starts it
    there and registers its end with ``ctx.on_teardown``, so every exit path ends it.
    """

    Settings: ClassVar[type[msgspec.Struct]] = NoSettings
    tools: ClassVar[Sequence[ToolSpec]] = ()  # what a demonstration's first render offers

    def __init__(self, settings: Any, seed: int, system_prompt: str) -> None:
        self.settings = settings
        self.seed = seed  # the run's: per-episode seeds derive from it
        self.system_prompt = system_prompt

    async def start(self, ctx: SetupContext) -> None:
        """Start what the environments need (a server, a process); nothing by default."""

    def dataset(self, batch_size: int) -> Dataset:
        """Training tasks: batch ``i`` a pure function of (seed, i), so a resume is exact."""
        raise NotImplementedError

    def eval_tasks(self, n: int) -> Sequence[Any]:
        """``n`` held-out tasks, never trained on, the same in every process."""
        raise NotImplementedError

    def make_env(self, index: int, row: int, settings: EnvSettings) -> ChatEnvironment:
        """The environment of episode ``row`` of the rollout of data ``index`` (-1: an
        evaluation); its seed derives from (run seed, index, row)."""
        raise NotImplementedError

    def demonstration(self, task: Any) -> list[ChatMessage]:
        """The ideal episode of ``task`` as messages: what the warm start
        ``hf_agentic_sft`` learns from (a task without them does not override this)."""
        raise NotImplementedError

    def demonstrations(self, n: int, batch_size: int) -> Dataset:
        """The tasks demonstrated: the first ``n`` training tasks in shuffled batches,
        or (0) a fresh batch of training tasks every step."""
        if n:
            return ShuffledBatches(self.dataset(n).batch(0), batch_size, self.seed, shuffle=True)
        return self.dataset(batch_size)

    async def submitted(self, inbox: EpisodeInbox, n: int) -> list[Episode]:
        """The next ``n`` groups of submitted episodes (``trainer.episodes =
        "submitted"``); a task whose own process submits them watches it here."""
        return await inbox.take(n)

    def success(self, episode: Episode) -> bool:
        """An episode that did the task: it ended and earned the full reward of 1."""
        return episode.status == "done" and episode.reward == 1


def task_class(name: str) -> type[ChatTask]:
    """The ChatTask class ``trainer.task`` names (checked against TASKS by the schema)."""
    module_name, _, attr = TASKS[name].partition(":")
    task: type[ChatTask] = getattr(importlib.import_module(module_name), attr)
    return task


def has_demonstrations(name: str) -> bool:
    return task_class(name).demonstration is not ChatTask.demonstration


def task_settings(name: str, table: dict[str, Any]) -> msgspec.Struct:
    """``[trainer.environment]`` as task ``name``'s settings; ValueError naming the key
    (the config's check turns it into exit 2)."""
    try:
        return msgspec.convert(table, task_class(name).Settings)
    except msgspec.ValidationError as exc:
        raise ValueError(f"`$.environment` for task {name!r}: {exc}") from None
