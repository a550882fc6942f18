"""The policy endpoint on its own: the OpenAI API through httpx and the ``openai``
package on asyncio and trio, tool calls, streaming, 32 agents at once (batched), the
documented 4xx answers to bad requests (and still serving after 1,000 of them), the
bearer token, and trajectory capture token for token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest
import torch

from corun.base.config import ServeConfig
from corun.contract.episodes import Episode, EpisodeInbox
from corun.execution.compute import Lane
from corun.serve.server import Endpoint
from trainers.agentic import calculator
from trainers.agentic.policy import build_agent
from trainers.agentic.serving import CalculatorPolicy
from trainers.lm.engine import LocalEngine

pytestmark = pytest.mark.anyio
MODEL = "calc"
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


class Shape:
    d_model, n_layers, n_heads = 32, 1, 2


def policy(lane: Lane) -> CalculatorPolicy:
    """The calculator policy of a fresh tiny TinyLM, generating on ``lane``."""
    torch.manual_seed(0)
    engine = LocalEngine(build_agent(Shape()))
    return CalculatorPolicy(MODEL, calculator.MAX_LEN, lambda: engine, lane)


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[tuple[Endpoint, EpisodeInbox]]:
    inbox, lane = EpisodeInbox(), Lane("serve")
    endpoint = Endpoint(policy(lane), ServeConfig(enabled=True, **settings), lane, inbox)
    async with endpoint.running():
        yield endpoint, inbox


def chat(content: str = "123+456=", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 10, **extra}  # fmt: skip


async def test_models_completions_and_chat_over_httpx(anyio_backend: str) -> None:
    with anyio.fail_after(30):
        async with serving() as (endpoint, _), httpx.AsyncClient(base_url=endpoint.url) as http:
            models = (await http.get("/v1/models")).json()
            assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 48
            done = (await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "123+456=", "max_tokens": 5, "logprobs": 1,
            })).json()  # fmt: skip
            choice = done["choices"][0]
            assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) <= 5
            assert choice["text"] == calculator.decode(choice["token_ids"])
            reply = (await http.post("/v1/chat/completions", json=chat(logprobs=True))).json()
            tokens = reply["choices"][0]["logprobs"]["content"]
            assert [t["logprob"] < 0 for t in tokens] and reply["version"] == 0


async def test_openai_client_and_streaming(anyio_backend: str) -> None:
    """The ``openai`` package as a client: a greedy reply, the same reply streamed as
    chunks, and the token ids riding along (``model_extra``)."""
    with anyio.fail_after(30):
        async with serving() as (endpoint, _):
            client = openai.AsyncOpenAI(base_url=f"{endpoint.url}/v1", api_key="unused")
            response = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "123+456="}],
                max_tokens=10, temperature=0,
            )  # fmt: skip
            choice = response.choices[0]
            assert choice.model_extra is not None and choice.model_extra["token_ids"]
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "123+456="}],
                max_tokens=10, temperature=0, stream=True,
            )  # fmt: skip
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert streamed == (choice.message.content or "")
            await client.close()


def test_a_well_formed_call_is_a_tool_call() -> None:
    served = policy(Lane("unused"))
    reply = served.reply([*calculator.encode("(123+456)"), calculator.EOS], ["calculator"])
    assert reply.content is None
    assert json.loads(reply.tool_calls[0].function.arguments) == {"expression": "123+456"}
    assert served.reply(calculator.encode("579"), ["calculator"]).content == "579"
    assert served.reply(calculator.encode("(1+2)"), []).content == "(1+2)"  # no tool offered


async def test_32_agents_at_once_share_batches(anyio_backend: str) -> None:
    with anyio.fail_after(60):
        async with serving(batch_wait_ms=20) as (endpoint, _):
            async with httpx.AsyncClient(base_url=endpoint.url) as http:
                codes: list[int] = []

                async def agent() -> None:
                    codes.append((await http.post("/v1/chat/completions", json=chat())).status_code)

                async with anyio.create_task_group() as agents:
                    for _ in range(32):
                        agents.start_soon(agent)
            assert codes == [200] * 32
            assert endpoint.batcher.batches < 32  # generated together, not one by one


async def test_ignore_eos_runs_every_reply_to_max_tokens(anyio_backend: str) -> None:
    """vLLM's ``ignore_eos`` (what ``vllm bench serve --ignore-eos`` sends): an EOS
    sampled ends nothing, so every reply has ``max_tokens`` tokens, streamed or not."""
    with anyio.fail_after(60):
        async with serving() as (endpoint, _), httpx.AsyncClient(base_url=endpoint.url) as http:

            async def finishes(**extra: Any) -> list[tuple[str, int]]:
                replies = [(await http.post("/v1/chat/completions", json=chat(
                    seed=seed, max_tokens=20, **extra))).json() for seed in range(12)]  # fmt: skip
                return [(r["choices"][0]["finish_reason"], len(r["choices"][0]["token_ids"]))
                        for r in replies]  # fmt: skip

            stopping = await finishes()
            assert any(finish == "stop" and n < 20 for finish, n in stopping)  # EOS is sampled
            assert await finishes(ignore_eos=True) == [("length", 20)] * 12
            streamed = {"model": MODEL, "prompt": "1+2=", "max_tokens": 20, "stream": True,
                        "ignore_eos": True, "seed": 3, "logprobs": 0}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=streamed) as response:
                events = [json.loads(line[6:]) async for line in response.aiter_lines()
                          if line.startswith("data: {")]  # fmt: skip
            assert sum(len(e["choices"][0].get("token_ids") or []) for e in events) == 20


BAD: list[tuple[str, Callable[[httpx.AsyncClient], Any], int, str | None]] = [
    ("malformed JSON", lambda h: h.post("/v1/chat/completions", content=b"{nope"), 400, None),
    ("wrong type", lambda h: h.post("/v1/chat/completions", json=chat(temperature="hot")), 400,
     "temperature"),
    ("bad role", lambda h: h.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "robot", "content": "1"}]}), 400,
     "messages[0].role"),
    ("no messages", lambda h: h.post("/v1/chat/completions", json={
        "model": MODEL, "messages": []}), 400, "messages"),
    ("unknown model", lambda h: h.post("/v1/chat/completions", json=chat(model="gpt-9")), 404,
     "model"),
    ("too long", lambda h: h.post("/v1/chat/completions", json=chat(max_tokens=48)), 400,
     "max_tokens"),
    ("not in vocabulary", lambda h: h.post("/v1/chat/completions", json=chat("hello")), 400,
     "messages"),
    ("unknown route", lambda h: h.get("/v1/nothing"), 404, None),
    ("wrong method", lambda h: h.get("/v1/chat/completions"), 405, None),
    ("unknown episode", lambda h: h.post("/v1/episodes/x/reward", json={"reward": 1}), 404,
     "episode_id"),
]  # fmt: skip


async def test_bad_requests_get_json_4xx_and_serving_goes_on(anyio_backend: str) -> None:
    with anyio.fail_after(120):
        async with serving() as (endpoint, _), httpx.AsyncClient(base_url=endpoint.url) as http:
            for name, send, status, param in BAD:
                response = await send(http)
                assert response.status_code == status, (name, response.text)
                error = response.json()["error"]
                assert error["message"] and error["type"], name
                assert param is None or error["param"] == param, (name, error)
            for i in range(1000):
                name, send, status, _ = BAD[i % len(BAD)]
                assert (await send(http)).status_code == status, name
            assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200


async def test_bearer_token(anyio_backend: str) -> None:
    with anyio.fail_after(30):
        async with serving(token="s3cret") as (endpoint, _):
            async with httpx.AsyncClient(base_url=endpoint.url) as http:
                assert (await http.get("/v1/models")).status_code == 401
                wrong = {"Authorization": "Bearer nope"}
                response = await http.get("/v1/models", headers=wrong)
                assert response.status_code == 401 and response.json()["error"]["code"]
                right = {"Authorization": "Bearer s3cret"}
                assert (await http.get("/v1/models", headers=right)).status_code == 200


async def test_an_episode_is_recorded_token_for_token(anyio_backend: str) -> None:
    """Two turns through the endpoint: the episode holds the prompt, the first reply's
    sampled ids (trained), the tool result's tokens (not trained), the second reply's
    ids — exactly what was sent and received, never re-tokenized."""
    with anyio.fail_after(30):
        async with serving() as (endpoint, inbox), httpx.AsyncClient(base_url=endpoint.url) as h:
            first = (await h.post("/v1/chat/completions", json=chat(
                episode_id="e1", group="g", tools=TOOLS, temperature=1.0))).json()  # fmt: skip
            message = first["choices"][0]["message"]
            messages = [{"role": "user", "content": "123+456="}, message,
                        {"role": "tool", "tool_call_id": "x", "content": "=579"}]  # fmt: skip
            second = (await h.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 10, "episode_id": "e1",
                "tools": TOOLS})).json()  # fmt: skip
            diverged = await h.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "1+1="}, *messages[1:],
                second["choices"][0]["message"], {"role": "user", "content": "1"}],
                "episode_id": "e1", "max_tokens": 5})  # fmt: skip
            assert diverged.status_code == 409
            done = await h.post("/v1/episodes/e1/reward", json={"reward": 0.5})
            assert done.json()["submitted"] and done.json()["turns"] == 2
        inbox.group_size = 1
        episode = (await inbox.take(1))[0]
    ids1, ids2 = (r["choices"][0]["token_ids"] for r in (first, second))
    observation = calculator.encode_observation("=579")
    assert episode.prompt_ids == calculator.encode("123+456=")
    assert episode.ids == [*ids1, *observation, *ids2]
    assert episode.trained == [True] * len(ids1) + [False] * len(observation) + [True] * len(ids2)
    assert episode.reward == 0.5 and episode.group == "g" and episode.versions[0] == 0


async def test_an_inbox_full_of_begun_groups_still_completes_them(anyio_backend: str) -> None:
    """A full inbox holds new groups back, never the episodes that complete a begun one
    (else begun groups and a waiting trainer would wait on each other forever)."""
    inbox = EpisodeInbox(capacity=4)
    inbox.group_size = 2
    with anyio.fail_after(10):
        for group in "abcd":
            await inbox.put(Episode(prompt_ids=[1], group=group))
        with anyio.move_on_after(0.05) as new_group:
            await inbox.put(Episode(prompt_ids=[1], group="e"))
        assert new_group.cancelled_caught  # full: a new group waits
        await inbox.put(Episode(prompt_ids=[1], group="a"))  # completes "a": no wait
        assert [e.group for e in await inbox.take(1)] == ["a", "a"]
