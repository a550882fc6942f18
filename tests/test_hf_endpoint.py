"""The endpoint over a Hugging Face policy: the built-in tiny Llama on the transformers
engine behind :class:`EnginePolicy`, driven by the ``openai`` client — plain and
streamed replies, tools offered, ``n``, ``stop``, ``top_logprobs``; tool calls streamed
as deltas the SDK accumulates; an episode's own base URL used by a client that knows
nothing of corun, recorded token for token (the trained ids are the ``token_ids`` sent,
a tool result is in the transcript once and untrained), a rewritten history refused
with a 409 naming the first message that differs.

The tiny model's weights are random, so it writes no tool calls of its own: the tool
call replies come from a scripted engine that answers with the template's own ids of
a call, and the recorded conversation carries tool calls the way a client re-sends
them (in its history)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest

from corun.agents.chat import ChatTemplate
from corun.agents.served import EnginePolicy
from corun.base.config import ServeConfig
from corun.contract.engine import Engine, EngineWrapper, Generation, Sampling
from corun.contract.episodes import EpisodeInbox
from corun.contract.policy import (
    ChatMessage,
    Completion,
    FunctionCall,
    ServeError,
    ToolCall,
    ToolSpec,
)
from corun.contract.policy import Sampling as PolicySampling
from corun.engines.transformers_engine import TransformersEngine
from corun.execution.compute import Lane
from corun.serve.batching import Batcher
from corun.serve.server import Endpoint
from trainers.hf.policy import load_policy

pytestmark = pytest.mark.anyio
MODEL = "tiny"
TOOLS: list[Any] = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
ASK: list[Any] = [{"role": "user", "content": "Ann has 12 pens and gets 7."}]
# A conversation as a client re-sends it: its own tool call, the tool's result.
CALLED: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "12+7"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "19"}]  # fmt: skip


class Scripted(EngineWrapper):
    """Answers every prompt with ``ids`` (a test's scripted reply); asked for top
    log-probs, each position's alternatives are its own token and the one after it."""

    def __init__(self, inner: Engine, ids: list[int]) -> None:
        super().__init__(inner)
        self.ids = ids

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        n = len(self.ids)
        top = None
        if sampling.top_logprobs:
            after = [*self.ids[1:], 0]
            top = [[(i, -0.5), (j, -1.5)] for i, j in zip(self.ids, after, strict=True)]
        return [Generation(list(self.ids), [-0.5] * n, [0] * n, "stop", top) for _ in prompts]


@asynccontextmanager
async def serving(
    scripted: list[int] | None = None, token: str = ""
) -> AsyncIterator[tuple[str, EpisodeInbox, ChatTemplate]]:
    policy, tokenizer = load_policy("tiny-llama", "test")
    template = ChatTemplate(tokenizer)
    engine: Engine = TransformersEngine(
        policy, template.pad_id, Lane("engine"), owns_lane=True, interrupt=False
    )
    if scripted is not None:
        engine = Scripted(engine, scripted)
    served = EnginePolicy(MODEL, engine, template, 256, {0: "weights-0"}, continuous_batching=False)
    inbox, lane = EpisodeInbox(), Lane("serve")
    endpoint = Endpoint(served, ServeConfig(enabled=True, token=token), lane, inbox)
    try:
        async with endpoint.running() as url:
            yield url, inbox, template
    finally:
        await engine.shutdown()


async def test_replies_through_the_openai_client(anyio_backend: str) -> None:
    with anyio.fail_after(60):
        async with serving() as (url, _, template):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            ask: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 12,
                                   "temperature": 0, "tools": TOOLS}  # fmt: skip
            plain = await client.chat.completions.create(**ask)
            choice = plain.choices[0]
            ids = (choice.model_extra or {})["token_ids"]
            assert choice.message.content == template.decode(ids)
            assert plain.usage is not None and plain.usage.completion_tokens == len(ids)

            stream = await client.chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
                choice.message.content
            )
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)

            two = await client.chat.completions.create(**ask | {"temperature": 1.0}, n=2, seed=3)
            assert [c.index for c in two.choices] == [0, 1]

            stop = template.decode(ids[4:6])  # a stop string from the greedy reply's middle
            cut = await client.chat.completions.create(**ask, stop=[stop])
            assert cut.choices[0].finish_reason == "stop"
            assert cut.choices[0].message.content == choice.message.content.split(stop)[0]  # type: ignore[union-attr]

            top = await client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
            tokens = top.choices[0].logprobs.content  # type: ignore[union-attr]
            assert tokens and all(len(t.top_logprobs) == 3 for t in tokens)
            assert all(t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob for t in tokens)
            await client.close()


async def test_tool_calls_stream_as_deltas(anyio_backend: str) -> None:
    _, tokenizer = load_policy("tiny-llama", "test")
    template = ChatTemplate(tokenizer)
    arguments = '{"expression": "12+7"}'
    call = ToolCall(id="x", function=FunctionCall(name="calculator", arguments=arguments))
    reply = ChatMessage(role="assistant", content="Adding.", tool_calls=[call])
    ids = template.reply_ids([ChatMessage(role="user", content=ASK[0]["content"])], reply)
    with anyio.fail_after(60):
        async with serving(scripted=ids) as (url, _, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            ask: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS}
            done = await client.chat.completions.create(**ask)
            assert done.choices[0].finish_reason == "tool_calls"
            message = done.choices[0].message
            assert message.content == "Adding." and message.tool_calls
            async with client.chat.completions.stream(**ask) as stream:
                final = await stream.get_final_completion()
            streamed = final.choices[0].message
            assert streamed.content == "Adding." and streamed.tool_calls
            assert streamed.tool_calls[0].function.name == "calculator"  # type: ignore[union-attr]
            arguments = streamed.tool_calls[0].function.arguments  # type: ignore[union-attr]
            assert json.loads(arguments) == {"expression": "12+7"}
            assert final.choices[0].finish_reason == "tool_calls"
            await client.close()


async def test_an_episode_base_url_records_the_conversation(anyio_backend: str) -> None:
    """A client configured with the episode's base URL alone; two turns; the recorded
    transcript is the prompt, the sampled ids (trained), the template's continuation
    (untrained: the tool result once), the next sampled ids."""
    with anyio.fail_after(60):
        async with serving() as (url, inbox, template):
            client = openai.AsyncOpenAI(base_url=f"{url}/episodes/ep-1/v1", api_key="unused")
            assert [m.id async for m in client.models.list()] == [MODEL]
            ask: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "tools": TOOLS}
            first = await client.chat.completions.create(messages=CALLED, **ask)
            said: Any = first.choices[0].message.model_dump(exclude_none=True)
            # The client re-sends its tool call with its JSON laid out otherwise.
            history = json.loads(json.dumps(CALLED))
            history[1]["tool_calls"][0]["function"]["arguments"] = '{"expression":"12+7"}'
            new: list[Any] = [{"role": "tool", "tool_call_id": "call_2", "content": "26"}]
            with pytest.raises(openai.BadRequestError, match="maximum context length"):
                await client.chat.completions.create(  # refused: the episode stays as it was
                    messages=[*history, said, *new], **ask | {"max_tokens": 10_000}
                )
            second = await client.chat.completions.create(messages=[*history, said, *new], **ask)
            answer = second.choices[0].message.model_dump()
            rewritten: list[Any] = [*history, said, *new, answer, ASK[0]]
            rewritten[3] = {"role": "assistant", "content": "something else"}
            with pytest.raises(openai.ConflictError, match=r"message 3 \(assistant\) differs"):
                await client.chat.completions.create(messages=rewritten, **ask)
            with pytest.raises(openai.BadRequestError, match="differs from the episode"):
                await client.chat.completions.create(
                    messages=CALLED, **ask, extra_body={"episode_id": "other"}
                )
            await client.close()
            async with httpx.AsyncClient(base_url=url) as http:
                reported = await http.post("/v1/episodes/ep-1/reward", json={"reward": 1.0})
                assert reported.json()["turns"] == 2
        inbox.group_size = 1
        episode = (await inbox.take(1))[0]
    ids1, ids2 = ((r.choices[0].model_extra or {})["token_ids"] for r in (first, second))
    sent = msgspec.convert(CALLED, list[ChatMessage])
    tools = msgspec.convert(TOOLS, list[ToolSpec])
    reply = ChatMessage(role="assistant", content=first.choices[0].message.content)
    stopped = first.choices[0].finish_reason == "stop"
    follow = template.continuation(
        [*sent, reply], msgspec.convert(new, list[ChatMessage]), tools, stopped=stopped
    )
    assert episode.prompt_ids == template.render(sent, tools)
    assert episode.ids == [*ids1, *follow, *ids2]
    assert episode.trained == [True] * len(ids1) + [False] * len(follow) + [True] * len(ids2)
    assert template.decode(follow).count("tool: 26") == 1
    assert template.decode(episode.prompt_ids + episode.ids).count("tool: 26") == 1
    assert episode.fingerprint == "weights-0" and episode.reward == 1.0


class Gated:
    """A served policy's ``generate`` alone: a 1-token request waits for ``gate``, a
    3-token one fails."""

    def __init__(self, continuous_batching: bool = True) -> None:
        self.continuous_batching = continuous_batching
        self.gate = anyio.Event()
        self.started = anyio.Event()
        self.calls: list[int] = []  # the prompts of each call

    async def generate(
        self, prompts: list[list[int]], sampling: PolicySampling, seed: int
    ) -> list[Completion]:
        self.calls.append(len(prompts))
        self.started.set()
        if sampling.max_tokens == 1:
            await self.gate.wait()
        if sampling.max_tokens == 3:
            raise RuntimeError("boom")
        return [Completion([7], [-1.0], [0], "stop") for _ in prompts]


async def test_a_batch_does_not_wait_for_the_one_before(anyio_backend: str) -> None:
    """While one generation runs, the next requests are generated (an engine that
    batches continuously takes them at once); a failure is its own requests' only."""
    policy = Gated()
    batcher = Batcher(policy, max_batch=8, wait_s=0.0)  # type: ignore[arg-type]
    answers: dict[int, Any] = {}

    async def ask(tokens: int) -> None:
        try:
            answers[tokens] = await batcher.generate([1, 2], PolicySampling(tokens, 1.0, 1.0), 0, 2)
        except ServeError as exc:
            answers[tokens] = exc.status

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(batcher.run)
            async with anyio.create_task_group() as first:
                first.start_soon(ask, 1)
                await policy.started.wait()
                await ask(2)  # answered while the first is still generating
                await ask(3)
                assert 1 not in answers and len(answers[2]) == 2 and answers[3] == 500
                policy.gate.set()
            tasks.cancel_scope.cancel()
    assert len(answers[1]) == 2


async def test_a_one_call_engine_gathers_the_next_batch_meanwhile(anyio_backend: str) -> None:
    """An engine that generates a call at a time (transformers): the requests that arrive
    while a call runs are gathered and then generated together, in one call."""
    policy = Gated(continuous_batching=False)
    batcher = Batcher(policy, max_batch=8, wait_s=0.0)  # type: ignore[arg-type]
    answers: list[Any] = []

    async def ask(tokens: int) -> None:
        answers.append(await batcher.generate([1, 2], PolicySampling(tokens, 1.0, 1.0), 0))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(batcher.run)
            async with anyio.create_task_group() as asking:
                asking.start_soon(ask, 1)
                await policy.started.wait()
                for _ in range(3):
                    asking.start_soon(ask, 2)
                await anyio.sleep(0.05)
                assert policy.calls == [1]  # the three wait for the running call
                policy.gate.set()
            tasks.cancel_scope.cancel()
    assert policy.calls == [1, 3] and len(answers) == 4
