"""A verifiers environment as an hf agentic run's chat task (``trainer.task =
"verifiers"``): its episodes are played by a worker process in a Python environment
of its own against the run's endpoint, and trained as submitted episodes.

verifiers 0.4 pins ``openai<3`` and corun's test extra needs ``openai>=3``, so the
worker (trainers/hf/verifiers_env/corun_verifiers_worker.py) runs under
``[trainer.environment] python`` (built by ``python -m trainers.hf.verifiers_env``).
It starts once the endpoint serves, plays each episode on the episode's own base URL
(every model call captured token for token), and posts the rubric's reward, which
waits while the run holds two steps' worth: the endpoint's backpressure. It ends at
teardown on every exit path, and with this process if it is SIGKILLed
(``ChildProcess.python_module``).

The default taskset, ``corun-word-problems``, is a verifiers taskset over a local JSONL
file of the built-in word problems that the run writes (no hub); the held-out
evaluation is corun's own (greedy, in process) on held-out word problems, scored as
the taskset's rubric scores them.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from corun import ConfigError, Dataset, SetupContext, stable_seed
from corun.agents.chat import ChatMessage, ToolSpec
from corun.agents.chat_runner import ChatStep
from corun.contract.episodes import Episode, EpisodeInbox
from corun.execution.procs import ChildProcess, last_line
from trainers.agentic.calculator import EnvSettings
from trainers.hf.chat_tasks import ChatTask
from trainers.hf.rewards import numeric_match
from trainers.hf.tasks import Example, WordProblems, draw, eval_problems

WORKER_DIR = Path(__file__).with_name("verifiers_env")
WORKER = "corun_verifiers_worker"
WORD_PROBLEMS = "corun-word-problems"
WATCH_S = 0.5  # how often a rollout waiting on episodes checks the worker is alive


class WorkerExited(RuntimeError):
    """The worker ended while the run waited on its episodes."""


class VerifiersSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[trainer.environment]`` of ``task = "verifiers"``."""

    python: str = ".venv-verifiers/bin/python"  # the verifiers environment's interpreter
    taskset: str = WORD_PROBLEMS  # a verifiers taskset id (a module in that environment)
    taskset_args: dict[str, Any] = msgspec.field(default_factory=dict)  # its settings
    harness: str = "corun-chat"  # a verifiers harness id: who plays the task
    problems: int = 4096  # word problems written for the default taskset
    ready_timeout_s: float = 180.0  # for the worker to import verifiers and load


class VerifiersTask(ChatTask):
    Settings = VerifiersSettings
    settings: VerifiersSettings

    worker: ChildProcess | None = None
    log = Path("verifiers_worker.log")  # the worker's stderr, in the run directory

    async def start(self, ctx: SetupContext) -> None:
        """Checked at set-up; the worker starts once the endpoint serves."""
        config = ctx.config
        check_run(config)
        python = self.settings.python
        if not os.access(python, os.X_OK):
            raise ConfigError(
                f"`$.trainer.environment.python`: no interpreter at {python!r}; build the "
                "verifiers environment with `python -m trainers.hf.verifiers_env`"
            )
        args = await anyio.to_thread.run_sync(self.worker_args, config)  # writes the tasks
        log = self.log = Path(config.run_dir) / "verifiers_worker.log"
        ctx.on_teardown("verifiers_worker", lambda: anyio.to_thread.run_sync(self.stop))

        async def launch(url: str) -> None:
            await self.launch(url, args, log)

        ctx.on_serving(launch)

    def worker_args(self, config: Any) -> list[str]:
        trainer, s = config.trainer, self.settings
        taskset_args = dict(s.taskset_args)
        if s.taskset == WORD_PROBLEMS and "path" not in taskset_args:
            path = Path(config.run_dir) / "verifiers_word_problems.jsonl"
            write_word_problems(path, s.problems, self.seed)
            taskset_args["path"] = str(path.resolve())
        return [
            "--model", config.run.name, "--taskset", s.taskset,
            "--taskset-args", json.dumps(taskset_args), "--harness", s.harness,
            "--batch", str(config.data.batch_size), "--group", str(trainer.samples_per_prompt),
            "--seed", str(self.seed), "--max-tokens", str(trainer.max_new_tokens),
            "--temperature", str(trainer.temperature),
        ]  # fmt: skip

    async def launch(self, url: str, args: list[str], log: Path) -> None:
        """Start the worker on ``url`` and wait for its ``ready``; one that exits first
        fails the run with its last line."""
        self.worker = await anyio.to_thread.run_sync(self._spawn, url, args, log)
        stdout = self.worker.popen.stdout
        assert stdout is not None
        with anyio.fail_after(self.settings.ready_timeout_s):
            line = await anyio.to_thread.run_sync(stdout.readline, abandon_on_cancel=True)
        if not line.startswith(b"ready"):  # its stdout closed: it is ending
            code = await anyio.to_thread.run_sync(self.worker.popen.wait)
            raise ConfigError(
                f"`$.trainer.environment`: the verifiers worker exited {code}: {last_line(log)}"
            )

    def _spawn(self, url: str, args: list[str], log: Path) -> ChildProcess:
        """The worker process (blocking: off the event loop), its stderr to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as stderr:
            return ChildProcess.python_module(
                WORKER, ["--url", url, *args], python=self.settings.python,
                env={**os.environ, "PYTHONPATH": str(WORKER_DIR)},
                stdout=-1, stderr=stderr,  # -1: subprocess.PIPE
            )  # fmt: skip

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    async def submitted(self, inbox: EpisodeInbox, n: int) -> list[Episode]:
        """The worker's episodes. Nothing else submits them: a worker that exits fails
        the run (naming its log's last line) instead of leaving it waiting forever."""
        episodes: list[Episode] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch_worker)
            episodes = await inbox.take(n)
            group.cancel_scope.cancel()
        return episodes

    async def _watch_worker(self) -> None:
        assert self.worker is not None, "the worker starts once the endpoint serves"
        # Polled: a thread blocked in wait() could not be cancelled, one left per step.
        while (code := self.worker.popen.poll()) is None:  # noqa: ASYNC110
            await anyio.sleep(WATCH_S)
        raise WorkerExited(f"the verifiers worker exited {code} mid-run: {last_line(self.log)}")

    def dataset(self, batch_size: int) -> Dataset:
        # Counts the steps: the episodes themselves are the worker's.
        return WordProblems(batch_size, self.seed)

    def eval_tasks(self, n: int) -> Sequence[Example]:
        return eval_problems(n)

    def make_env(self, index: int, row: int, settings: EnvSettings) -> WordProblemEnv:
        return WordProblemEnv(self.system_prompt)


def check_run(config: Any) -> None:
    if config.trainer.episodes != "submitted" or not config.serve.enabled:
        raise ConfigError(
            '`$.trainer.task` = "verifiers" plays its episodes through the endpoint: set '
            'trainer.episodes = "submitted" and serve.enabled = true'
        )


def write_word_problems(path: Path, n: int, seed: int) -> None:
    """``n`` training word problems (never a held-out one) as the taskset's JSONL."""
    rng = random.Random(stable_seed("verifiers-word-problems", seed))
    examples = (draw(rng, want_held_out=False) for _ in range(n))
    rows = [json.dumps({"prompt": str(e.prompt), "answer": e.answer}) for e in examples]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


class WordProblemEnv:
    """A held-out episode: the question, one reply, scored as the taskset's rubric
    scores it (the reply's last number is the answer)."""

    tools: Sequence[ToolSpec] = ()

    def __init__(self, system_prompt: str) -> None:
        self.system_prompt = system_prompt
        self.answer = ""

    async def reset(self, task: Example) -> list[ChatMessage]:
        self.answer = task.answer
        system = [ChatMessage(role="system", content=self.system_prompt)]
        return [
            *(system if self.system_prompt else []),
            ChatMessage(role="user", content=str(task.prompt)),
        ]

    async def step(self, reply: ChatMessage) -> ChatStep:
        return ChatStep([], numeric_match(response=reply.text(), answer=self.answer), done=True)
