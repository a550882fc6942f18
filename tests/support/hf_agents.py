"""What the agent-client tests share (tests/test_agent_clients.py): a tool-using Hugging
Face policy, an endpoint serving it in process, the calculator task as an OpenAI client
plays it, and two test kinds of the ``hf_agentic`` trainer.

- ``tool_model`` (a session fixture): the checkpoint of a short run of the
  hf_agentic_sft recipe — the built-in tiny Llama warm-started on calculator
  demonstrations for ``SFT_STEPS`` steps (~15 s on 2 cores), enough that it calls the
  calculator in the Hermes format: greedy, on every problem; at temperature 0.7 in
  ~9 of 10 replies (measured: 0 of 64 at 40 steps, 47/64 at 60, 59/64 at 80). The
  digits it copies are still mostly wrong (the full recipe's 160 steps fix them);
  these tests need the calls, not the sums.
- :func:`serving`: that checkpoint served by the endpoint in this process, as
  ``corun serve`` serves it (:class:`~corun.agents.served.EnginePolicy` on the
  transformers engine), with the inbox the recorded episodes go to.
- :func:`play`: one calculator episode through the ``openai`` SDK — the tool offered,
  the policy's call run here, the history re-sent with the result, the answer scored —
  plain or streamed (tool-call deltas accumulated as a framework does).
- :class:`Teams`: many such agents at once, in teams that play a problem together.
- ``RecordingHFAgentic``: ``hf_agentic`` keeping the episodes it trains on;
  ``SkipReloadHFAgentic``: ``hf_agentic`` whose engine silently skips the reload of one
  version (tests/support/faults.py's ``SkipReload``, from ``skip_reload_at`` on).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
import torch
from torch import Tensor

import corun
from corun import Lane
from corun.agents.chat import ChatTemplate
from corun.agents.served import EnginePolicy
from corun.base.config import ServeConfig
from corun.contract.engine import Engine
from corun.contract.episodes import Episode, EpisodeInbox
from corun.engines.transformers_engine import TransformersEngine
from corun.serve.server import Endpoint
from tests.support.faults import SkipReload
from trainers.agentic.calculator import Problem, Problems, answer_reward
from trainers.hf.agentic import HFAgenticConfig, HFAgenticGRPOTrainer
from trainers.hf.rl import chat_template
from trainers.hf.state import load_model
from trainers.hf.tools import TOOL_ERROR, TOOLS

if TYPE_CHECKING:  # (imported by the tests that use it: 0.7 s that every session would pay)
    import openai

MODEL = "hf_agentic"  # the served model's name: the recipe's run.name
SFT_STEPS = 80
TOOL_SPECS: list[dict[str, Any]] = msgspec.to_builtins(TOOLS)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of ``SFT_STEPS`` steps of the hf_agentic_sft recipe."""
    run_dir = tmp_path_factory.mktemp("hf-agentic-sft")
    config = corun.load_config("hf_agentic_sft", [
        f"run.dir={run_dir}", f"run.steps={SFT_STEPS}", f"loop.save_interval={SFT_STEPS}",
        "loop.baseline_eval=false", "loop.eval_interval=0", "log.progress=off",
    ])  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tests/conftest.py's reason; its fixture is per test)
    try:
        trainer = corun.resolve_trainer(config.trainer.kind)(config)
        anyio.run(corun.run, trainer, config)
    finally:
        torch.set_num_threads(threads)
    return run_dir / "checkpoints" / f"step-{SFT_STEPS}"


# ----------------------------------------------------------------------------- serving


@dataclass
class Served:
    url: str
    inbox: EpisodeInbox
    template: ChatTemplate


@asynccontextmanager
async def serving(checkpoint: Path, *, max_batch: int = 64) -> AsyncIterator[Served]:
    """``checkpoint``'s policy on the endpoint, in this event loop (asyncio or trio)."""
    policy, tokenizer = load_model("tiny-llama", str(checkpoint), "`tool_model`")
    template = chat_template(policy, tokenizer, _NoSystemPrompt())
    engine = TransformersEngine(
        policy, template.pad_id, Lane("engine"), owns_lane=True, interrupt=False
    )
    served = EnginePolicy(MODEL, engine, template, 256, {0: "weights-0"}, continuous_batching=False)
    inbox = EpisodeInbox()
    endpoint = Endpoint(served, ServeConfig(enabled=True, max_batch=max_batch),
                        Lane("serve"), inbox)  # fmt: skip
    try:
        async with endpoint.running() as url:
            yield Served(url, inbox, template)
    finally:
        await engine.shutdown()


class _NoSystemPrompt:
    model = "tiny-llama"
    system_prompt = ""


async def taken(inbox: EpisodeInbox, n: int) -> list[Episode]:
    """The first ``n`` episodes rewarded, in order (one at a time: several of one task
    are one group)."""
    inbox.group_size = 1
    return [episode for _ in range(n) for episode in await inbox.take(1)]


# ----------------------------------------------------------------------------- the task


def question(problem: Problem) -> str:
    return f"What is {problem.a}+{problem.b}?"  # as trainers/hf/tools.py asks


def calculate(expression: str) -> str:
    """The calculator tool: ``a+b`` → the sum; anything else, the task's error text."""
    left, plus, right = expression.partition("+")
    if plus and left.strip().isdigit() and right.strip().isdigit():
        return str(int(left) + int(right))
    return TOOL_ERROR


def run_call(arguments: str) -> str:
    """The tool message for a call's JSON ``arguments``."""
    try:
        expression = json.loads(arguments).get("expression")
    except (ValueError, AttributeError):
        return TOOL_ERROR
    return calculate(expression) if isinstance(expression, str) else TOOL_ERROR


def reward(problem: Problem, answer: str | None) -> float:
    """The calculator task's score of a final answer (1: exactly the sum)."""
    return answer_reward(problem.answer, (answer or "").strip())


# ----------------------------------------------------------------------------- an episode


@dataclass
class Turn:
    """One reply as the client saw it."""

    message: dict[str, Any]  # as re-sent in the history
    version: int
    finish: str
    token_ids: list[int] | None  # (not in a stream's chunks)


@dataclass
class Played:
    messages: list[dict[str, Any]]  # the conversation, the final reply last
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    outgrew: bool = False  # a request was refused: longer than the model takes

    @property
    def tool_calls(self) -> int:
        return sum(len(t.message.get("tool_calls") or ()) for t in self.turns)


async def play(
    client: openai.AsyncOpenAI, problem: Problem, *, stream: bool = False,
    temperature: float = 0.0, max_turns: int = 2,
) -> Played:  # fmt: skip
    """One episode: ask, run each calculator call and re-send the history with its
    result, until the policy answers in text, or after ``max_turns`` replies, or when
    the conversation outgrows the model (the tiny model has 256 positions; a tool call
    is ~85 tokens)."""
    import openai

    played = Played([{"role": "user", "content": question(problem)}])
    for turn_index in range(max_turns):
        ask: dict[str, Any] = {"model": MODEL, "messages": played.messages, "tools": TOOL_SPECS,
                               "max_tokens": 96, "temperature": temperature}  # fmt: skip
        try:
            turn = await (_streamed(client, ask) if stream else _plain(client, ask))
        except openai.BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            played.outgrew = True  # no answer (reward 0); the episode is as it was
            break
        played.turns.append(turn)
        played.messages.append(turn.message)
        calls = turn.message.get("tool_calls") or []
        if not calls:
            played.reward = reward(problem, turn.message.get("content"))
            break
        if turn_index == max_turns - 1:
            break  # out of turns: no answer (reward 0)
        for call in calls:
            result = run_call(call["function"]["arguments"])
            played.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return played


async def _plain(client: openai.AsyncOpenAI, ask: dict[str, Any]) -> Turn:
    done = await client.chat.completions.create(**ask)
    choice = done.choices[0]
    message = choice.message.model_dump(include={"role", "content", "tool_calls"})
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    extra = choice.model_extra or {}
    return Turn(message, (done.model_extra or {})["version"], choice.finish_reason,
                extra["token_ids"])  # fmt: skip


async def _streamed(client: openai.AsyncOpenAI, ask: dict[str, Any]) -> Turn:
    """A streamed reply, its content and tool-call deltas accumulated by index."""
    stream = await client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    content, calls, finish, version = "", dict[int, dict[str, Any]](), "", -1
    async for chunk in stream:
        version = max(version, (chunk.model_extra or {})["version"])
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "type": "function",
                                        "function": {"name": "", "arguments": ""}})  # fmt: skip
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return Turn(message, version, finish, None)


@dataclass
class Teams:
    """Agents that practise in teams of ``group`` through an endpoint, forever: a team's
    agents play one problem at once (a GRPO group), each episode on its own base URL
    (copies of ``client``, sharing its connections), and report their rewards.
    Every reply's version is kept, and any failure (an ``openai`` error, a reward
    refused) as a line."""

    client: openai.AsyncOpenAI
    http: Any  # an httpx.AsyncClient
    url: str
    group: int
    temperature: float = 0.7
    versions: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    async def team(self, k: int) -> None:
        for i in itertools.count():
            problem = Problems(1, seed=k).batch(i)[0]
            async with anyio.create_task_group() as members:
                for j in range(self.group):
                    members.start_soon(self.agent, problem, f"team{k}-{i}-{j}")

    async def agent(self, problem: Problem, name: str) -> None:
        import openai

        client = self.client.with_options(base_url=f"{self.url}/episodes/{name}/v1")
        try:
            played = await play(client, problem, temperature=self.temperature)
            self.versions.extend(t.version for t in played.turns)
            score = {"reward": played.reward}
            response = await self.http.post(f"{self.url}/v1/episodes/{name}/reward", json=score)
            if response.status_code != 200:
                self.failures.append(f"reward {response.status_code}: {response.text}")
        except openai.APIError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------- test kinds


class RecordingHFAgentic(HFAgenticGRPOTrainer):
    """``hf_agentic`` that keeps every episode it takes from its inbox (``taken``)."""

    taken: list[Episode]

    async def setup(self, ctx: corun.SetupContext) -> None:
        await super().setup(ctx)
        self.taken = []
        if self.inbox is not None:
            self.inbox = _RecordingInbox(self.inbox, self.taken)


class _RecordingInbox(EpisodeInbox):
    """The trainer's view of the run's inbox (a rollout only takes from it): what it
    takes is also kept."""

    def __init__(self, inner: EpisodeInbox, kept: list[Episode]) -> None:
        self.inner, self.kept = inner, kept

    async def take(self, groups: int) -> list[Episode]:
        episodes = await self.inner.take(groups)
        self.kept += episodes
        return episodes


class SkipReloadConfig(HFAgenticConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):  # type: ignore[misc,valid-type,call-arg]
    skip_reload_at: int = 1  # the first version whose reload the engine skips


class SkipReloadHFAgentic(HFAgenticGRPOTrainer):
    """``hf_agentic`` whose engine silently skips its weight reloads from version
    ``skip_reload_at`` on: the verified sync must fail the run there."""

    Config = SkipReloadConfig

    async def wrap_engine(self, engine: Engine) -> Engine:
        return _SkipFrom(engine, self.config.skip_reload_at)


class _SkipFrom(SkipReload):
    def __init__(self, inner: Engine, first: int) -> None:
        super().__init__(inner)
        self.first = first

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        if version < self.first:
            await self.inner.update_weights(state, version)
        else:
            await super().update_weights(state, version)
