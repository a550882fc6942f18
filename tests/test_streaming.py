"""Streamed replies: tokens sent as they are generated (corun/serve/streaming.py).

On the transformers engine (tiny Llama, each decode step slowed so a reply takes a
while): the first content chunk arrives while the engine is still decoding; the deltas
joined are the non-stream reply for the same seed, token for token with log-probs and
versions; include_usage. With a scripted streaming engine: text before a tool call
streams, the marker and the call never leak into content, the call comes as tool-call
deltas; a stop string's text (or a partial one) is never sent and its row stops. A
client that disconnects mid-stream stops its row (the call's other row goes on to its
end) and frees the batcher. In-process vLLM: tests/test_streaming_vllm.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from corun.agents.chat import ChatTemplate
from corun.agents.served import EnginePolicy
from corun.base.config import ServeConfig
from corun.contract.engine import Delta, Engine, EngineWrapper, Generation, Sampling, TokenSink
from corun.contract.episodes import EpisodeInbox
from corun.engines.transformers_engine import TransformersEngine
from corun.execution.compute import Lane
from corun.serve.server import Endpoint
from trainers.hf.policy import load_policy

MODEL = "tiny"
ASK = [{"role": "user", "content": "Ann has 12 pens and gets 7."}]
TOOLS: list[Any] = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


@dataclass
class Served:
    url: str
    endpoint: Endpoint
    template: ChatTemplate
    engine: Engine
    steps: list[int] = field(default_factory=lambda: [0])  # decode steps run


@asynccontextmanager
async def serving(
    engine_of: Any = None, step_s: float = 0.0, batch_wait_ms: float = 0.0,
    continuous: bool = False,
) -> AsyncIterator[Served]:  # fmt: skip
    """The tiny Llama's endpoint on the transformers engine (wrapped by ``engine_of``),
    each forward pass slowed by ``step_s`` and counted; ``continuous``: the endpoint
    runs each batch as its engine takes it (as a run serves it), else a call at a time."""
    policy, tokenizer = load_policy("tiny-llama", "test")
    template = ChatTemplate(tokenizer)
    local = TransformersEngine(policy, template.pad_id, Lane("engine"), owns_lane=True,
                               interrupt=False)  # fmt: skip
    steps = [0]

    def slowed(*_: Any) -> None:
        steps[0] += 1
        time.sleep(step_s)

    local.model.register_forward_hook(slowed)
    engine: Engine = local if engine_of is None else engine_of(local)
    policy_ = EnginePolicy(MODEL, engine, template, 256, {}, continuous_batching=continuous)
    config = ServeConfig(enabled=True, batch_wait_ms=batch_wait_ms)
    endpoint = Endpoint(policy_, config, Lane("serve"), EpisodeInbox())
    try:
        async with endpoint.running() as url:
            yield Served(url, endpoint, template, engine, steps)
    finally:
        await engine.shutdown()


def ask(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 1.0,
            "seed": 7} | extra  # fmt: skip


async def stream(
    http: httpx.AsyncClient, body: dict[str, Any], steps: list[int] | None = None,
    path: str = "/v1/chat/completions",
) -> list[tuple[dict[str, Any], int]]:  # fmt: skip
    """The chunks of a streamed request, each with the decode steps run when it came."""
    chunks = []
    async with http.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append((json.loads(line[6:]), steps[0] if steps else 0))
    return chunks


async def both(
    body: dict[str, Any], path: str = "/v1/chat/completions"
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], int]], int]:
    """The whole reply to ``body`` and its stream (with the decode steps at each chunk)
    from the slowed engine, and the stream's decode steps in all."""
    async with serving(step_s=0.02) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            whole = (await http.post(path, json=body)).json()
            served.steps[0] = 0
            chunks = await stream(http, body, served.steps, path)
    return whole, chunks, served.steps[0]


def content(chunks: Sequence[tuple[dict[str, Any], int]]) -> list[str]:
    return [c["choices"][0]["delta"].get("content") or "" for c, _ in chunks if c["choices"]]


@pytest.mark.anyio
async def test_tokens_stream_as_generated_and_join_to_the_reply(anyio_backend: str) -> None:
    with anyio.fail_after(120):
        body = ask(logprobs=True, stream_options={"include_usage": True})
        whole, chunks, steps = await both(body)
    reply = whole["choices"][0]
    pieces = [(c, s) for c, s in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    # The first text came while the engine was still decoding, the rest token by token.
    assert pieces[0][1] < steps / 2, (pieces[0][1], steps)
    assert len(pieces) > len(reply["token_ids"]) / 2
    assert "".join(content(chunks)) == reply["message"]["content"]
    sent = [t for c, _ in chunks if c["choices"] for t in
            (c["choices"][0]["logprobs"] or {}).get("content") or []]  # fmt: skip
    assert sent == reply["logprobs"]["content"]
    assert {c["version"] for c, _ in chunks} == {0}
    assert chunks[0][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2][0]["choices"][0]["finish_reason"] == reply["finish_reason"]
    assert chunks[-1][0]["choices"] == [] and chunks[-1][0]["usage"] == whole["usage"]


@pytest.mark.anyio
async def test_a_short_reply_streams_and_ends_while_a_long_one_generates(
    anyio_backend: str,
) -> None:
    """As a run serves it, the transformers engine batches continuously: a request sent
    once a long reply has begun gets its first text within a few decode steps (a
    bound loose for a loaded machine; a call at a time, it waited for ~150) and ends
    before the long reply does."""
    with anyio.fail_after(120):
        async with serving(step_s=0.01, continuous=True) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                ended: list[str] = []
                began = anyio.Event()
                short: list[tuple[dict[str, Any], int]] = []

                async def long() -> None:
                    body = ask(max_tokens=150, ignore_eos=True, seed=1) | {"stream": True}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if '"content":"' in line and '"content":""' not in line:
                                began.set()
                    ended.append("long")

                async def later() -> None:
                    await began.wait()
                    sent = served.steps[0]
                    short.extend(await stream(http, ask(max_tokens=5, seed=2), served.steps))
                    ended.append("short")
                    text = [s for c, s in short if c["choices"] and c["choices"][0]["delta"]
                            .get("content")]  # fmt: skip
                    assert text[0] - sent <= 20, (sent, text)  # not the ~150 left

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(long)
                    tasks.start_soon(later)
    assert ended == ["short", "long"]
    assert short[-1][0]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.anyio
async def test_legacy_completions_stream_as_generated(anyio_backend: str) -> None:
    with anyio.fail_after(120):
        body = {"model": MODEL, "prompt": "Ann has", "max_tokens": 16, "seed": 3, "logprobs": 1}
        reply, chunks, steps = await both(body, "/v1/completions")
    whole = reply["choices"][0]
    assert chunks[0][1] < steps / 2
    assert "".join(c["choices"][0]["text"] for c, _ in chunks) == whole["text"]
    assert [t for c, _ in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    logprobs = [lp for c, _ in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert logprobs == whole["logprobs"]["token_logprobs"]
    assert chunks[-1][0]["choices"][0]["finish_reason"] == whole["finish_reason"]


class Script(EngineWrapper):
    """Streams ``text``'s ids a token at a time, on the event loop; records the tokens
    handed over before the sink declined the row."""

    def __init__(self, inner: Engine, ids: list[int]) -> None:
        super().__init__(inner)
        self.ids = ids
        self.handed: list[int] = []

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        return await self.generate_stream(prompts, sampling, seed, lambda row, delta: True)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        self.handed = []
        for token in self.ids:
            await anyio.sleep(0.005)
            self.handed.append(token)
            if not sink(0, Delta([token], [-0.5], [0])):
                break
        n = len(self.handed)
        return [Generation(list(self.handed), [-0.5] * n, [0] * n, "stop")]


def scripted(text: str) -> Any:
    def wrap(engine: TransformersEngine) -> Script:
        tokenizer = load_policy("tiny-llama", "test")[1]
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        return Script(engine, ids)

    return wrap


@pytest.mark.anyio
async def test_text_before_a_tool_call_streams_and_the_call_comes_as_deltas(
    anyio_backend: str,
) -> None:
    call = '{"name": "calculator", "arguments": {"expression": "12+7"}}'
    with anyio.fail_after(120):
        async with serving(scripted(f"Adding up. <tool_call>{call}</tool_call>")) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                chunks = await stream(http, ask(tools=TOOLS))
    texts = content(chunks)
    assert "".join(texts) == "Adding up."
    assert not any("<" in t for t in texts)  # no part of the marker leaked as text
    assert sum(1 for t in texts if t) > 1  # the text streamed before the call
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c, _ in chunks
              if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]  # fmt: skip
    assert deltas[0]["function"]["name"] == "calculator" and deltas[0]["id"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"expression": "12+7"}
    assert chunks[-1][0]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_a_stop_string_is_never_sent_and_stops_the_row(anyio_backend: str) -> None:
    text = "Hello there, world. Bye for now and more words after it"
    with anyio.fail_after(120):
        async with serving(scripted(text)) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                whole = await http.post("/v1/chat/completions", json=ask(stop=["Bye"]))
                chunks = await stream(http, ask(stop=["Bye"], logprobs=True))
    assert isinstance(served.engine, Script)
    texts = content(chunks)
    expected = whole.json()["choices"][0]["message"]["content"]
    assert expected.startswith("Hello there, world.") and "B" not in expected
    assert "".join(texts) == expected
    assert not any("B" in t for t in texts)  # nor its start, held back while it might be one
    assert len(served.engine.handed) < len(served.engine.ids) - 3  # the row stopped early
    sent = [t for c, _ in chunks if c["choices"] for t in
            (c["choices"][0]["logprobs"] or {}).get("content") or []]  # fmt: skip
    assert len(sent) == len(whole.json()["choices"][0]["token_ids"])
    assert chunks[-1][0]["choices"][0]["finish_reason"] == "stop"


class Recorded(EngineWrapper):
    """The inner engine's streamed generations, each call's kept."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.calls: list[list[Generation]] = []

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        assert isinstance(self.inner, TransformersEngine)
        self.calls.append(await self.inner.generate_stream(prompts, sampling, seed, sink))
        return self.calls[-1]


@pytest.mark.anyio
async def test_a_client_that_leaves_stops_its_row_and_frees_the_batcher(
    anyio_backend: str,
) -> None:
    """Two streams in one generation call (one seed: one group); one client leaves after
    its first text: its row stops, the other runs to its end, the call returns, the
    batcher serves on."""
    with anyio.fail_after(120):
        async with serving(Recorded, step_s=0.02, batch_wait_ms=300) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                kept: list[Any] = []

                async def leaver() -> None:
                    body = ask(max_tokens=60) | {"stream": True}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if '"content":"' in line and '"content":""' not in line:
                                return  # leaves mid-stream

                async def stayer() -> None:
                    kept.extend(await stream(http, ask(max_tokens=60)))

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(leaver)
                    tasks.start_soon(stayer)
                assert isinstance(served.engine, Recorded)
                assert isinstance(served.engine.inner, TransformersEngine)
                await served.engine.inner.lane.run(lambda: None)  # the call has returned
                assert kept[-1][0]["choices"][0]["finish_reason"] == "length"
                [call] = served.engine.calls  # both rows in one call
                lengths = sorted(len(g.ids) for g in call)
                assert lengths[1] == 60 and lengths[0] < 30, lengths  # the leaver's stopped
                assert served.endpoint.batcher.batches == 1
                after = await http.post("/v1/chat/completions", json=ask(max_tokens=2))
                assert after.status_code == 200 and served.endpoint.batcher.batches == 2
