"""Every body the endpoint sends validates against OpenAI's official OpenAPI schemas
(tests/support/openai_schemas.json names its source and date): models, chat replies
plain, with tools, with ``n``, with ``stop`` and with log-probs, each also streamed;
tool calls, plain and streamed; an episode's own base URL; legacy completions; every
kind of error. And a token that holds part of a character reports its own bytes, so a
client rebuilds the text from ``bytes`` (in the content and in the top log-probs).

The spec is OpenAPI 3.1 (JSON Schema) but still marks a few fields OpenAPI 3.0's way,
``nullable: true``; they are read as the spec means them: that schema, or null."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from corun.agents.chat import ChatTemplate
from corun.contract.policy import ChatMessage, FunctionCall, ToolCall
from tests.test_hf_endpoint import ASK, CALLED, MODEL, TOOLS, serving
from trainers.hf.policy import load_policy

pytestmark = pytest.mark.anyio
SCHEMAS = Path(__file__).parent / "support" / "openai_schemas.json"
TOKEN = "secret"
SPLIT = "Ann paid 3 € for a café: 日本"  # characters of 2 and 3 bytes: split over tokens


def _nullable(schema: Any) -> Any:
    """``{..., "nullable": true}`` as ``{"anyOf": [{...}, {"type": "null"}]}``."""
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    inner = {key: _nullable(value) for key, value in schema.items() if key != "nullable"}
    return {"anyOf": [inner, {"type": "null"}]} if schema.get("nullable") else inner


DOCUMENT = _nullable(json.loads(SCHEMAS.read_text()))
URI = "urn:openai-openapi"
REGISTRY: Registry[Any] = Registry().with_resource(URI, Resource.opaque(DOCUMENT))


def check(name: str, body: Any) -> None:
    """``body`` validates against the spec's schema ``name``."""
    schema = {"$ref": f"{URI}#/components/schemas/{name}"}
    found = Draft202012Validator(schema, registry=REGISTRY).iter_errors(body)
    errors = [f"$.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in found]
    assert errors == [], (name, body)


def events(response: httpx.Response) -> list[Any]:
    """A server-sent event stream's JSON chunks (its closing ``[DONE]`` checked)."""
    assert response.status_code == 200, response.text
    data = [part.removeprefix("data: ") for part in response.text.split("\n\n") if part]
    assert data[-1] == "[DONE]"
    return [json.loads(part) for part in data[:-1]]


@asynccontextmanager
async def client(scripted: list[int] | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the tiny Llama's endpoint, which requires a bearer token; with
    ``scripted``, every reply is those ids."""
    async with serving(scripted, token=TOKEN) as (url, _, _):
        headers = {"authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            yield http


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0} | extra


async def replies(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    """The reply to ``body`` and its stream (with usage) validate."""
    reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    check("CreateChatCompletionResponse", reply.json())
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in events(await http.post(path, json=body | stream)):
        check("CreateChatCompletionStreamResponse", chunk)


async def test_replies_validate(anyio_backend: str) -> None:
    with anyio.fail_after(120):
        async with client() as http:
            check("ListModelsResponse", (await http.get("/v1/models")).json())
            for body in (
                chat(), chat(tools=TOOLS), chat(temperature=1.0, n=2, seed=3),
                chat(stop=[" ", "a"]), chat(logprobs=True, top_logprobs=3),
                chat(messages=CALLED, tools=TOOLS, logprobs=True, n=2, temperature=1.0),
            ):  # fmt: skip
                await replies(http, "/v1/chat/completions", body)
            legacy = {"model": MODEL, "prompt": "Ann has", "max_tokens": 4, "logprobs": 2}
            completion = await http.post("/v1/completions", json=legacy)
            check("CreateCompletionResponse", completion.json())
            streamed = events(await http.post("/v1/completions", json=legacy | {"stream": True}))
            assert len(streamed) > 1  # text as it is generated, then the finish
            for chunk in streamed[:-1]:  # before the last, no finish (null, as OpenAI's)
                assert chunk["choices"][0].pop("finish_reason") is None
                chunk["choices"][0]["finish_reason"] = "length"
            for chunk in streamed:
                check("CreateCompletionResponse", chunk)


async def test_an_episodes_base_url_validates(anyio_backend: str) -> None:
    with anyio.fail_after(60):
        async with client() as http:
            base = "/episodes/e1/v1"
            check("ListModelsResponse", (await http.get(f"{base}/models")).json())
            first = await http.post(f"{base}/chat/completions", json=chat(logprobs=True))
            check("CreateChatCompletionResponse", first.json())
            said = first.json()["choices"][0]["message"]["content"]
            follow = [*ASK, {"role": "assistant", "content": said},
                      {"role": "user", "content": "And then?"}]  # fmt: skip
            second = chat(messages=follow, logprobs=True, stream=True)
            for chunk in events(await http.post(f"{base}/chat/completions", json=second)):
                check("CreateChatCompletionStreamResponse", chunk)


async def test_tool_calls_validate(anyio_backend: str) -> None:
    template = ChatTemplate(load_policy("tiny-llama", "test")[1])
    arguments = '{"expression": "12+7"}'
    call = ToolCall(id="call_1", function=FunctionCall(name="calculator", arguments=arguments))
    reply = ChatMessage(role="assistant", content="Adding.", tool_calls=[call])
    ids = template.reply_ids([ChatMessage(role="user", content=ASK[0]["content"])], reply)
    with anyio.fail_after(60):
        async with client(scripted=ids) as http:
            body = chat(tools=TOOLS, logprobs=True, top_logprobs=2)
            await replies(http, "/v1/chat/completions", body)
            done = (await http.post("/v1/chat/completions", json=body)).json()
            assert done["choices"][0]["finish_reason"] == "tool_calls"


async def test_errors_validate(anyio_backend: str) -> None:
    refused = [  # (method, path, body or raw bytes, status, headers)
        ("POST", "/v1/chat/completions", b"{not json", 400, None),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
        ("POST", "/v1/chat/completions", chat(max_tokens=10**6), 400, None),
        ("POST", "/v1/chat/completions", chat(top_logprobs=2), 400, None),
        ("POST", "/v1/chat/completions", chat(model="other"), 404, None),
        ("GET", "/v1/models", None, 401, {"authorization": "Bearer wrong"}),
        ("GET", "/v1/nowhere", None, 404, None),
        ("POST", "/v1/episodes/none/reward", {"reward": 1.0}, 404, None),
        ("POST", "/v1/chat/completions", b"x" * (1 << 21), 413, None),
        ("POST", "/v1/chat/completions", b"x" * (8 << 20), 413, None),  # answered, not reset
        ("POST", "/episodes/e2/v1/chat/completions", chat(n=2), 400, None),
    ]
    with anyio.fail_after(60):
        async with client() as http:
            for method, path, body, status, headers in refused:
                content = body if isinstance(body, bytes) else None
                payload = None if isinstance(body, bytes) else body
                answer = await http.request(method, path, json=payload, content=content,
                                            headers=headers)  # fmt: skip
                assert answer.status_code == status, (path, answer.text)
                check("ErrorResponse", answer.json())
            # A conversation that differs from its recorded episode: 409.
            await http.post("/episodes/e3/v1/chat/completions", json=chat())  # recorded
            other = [*ASK, {"role": "assistant", "content": "no"}, {"role": "user", "content": "?"}]
            url = "/episodes/e3/v1/chat/completions"
            conflict = await http.post(url, json=chat(messages=other))
            assert conflict.status_code == 409, conflict.text
            check("ErrorResponse", conflict.json())


async def test_logprob_bytes_are_the_tokens_own(anyio_backend: str) -> None:
    """Joined, the ``bytes`` of a reply's tokens are the reply's UTF-8, though some of
    its tokens hold part of a character (their ``token`` text is U+FFFD); the top
    log-probs' too (the scripted engine offers each token and the next one)."""
    template = ChatTemplate(load_policy("tiny-llama", "test")[1])
    ids = template.ids(SPLIT)
    assert any("\ufffd" in template.token(i) for i in ids)  # the test's point
    with anyio.fail_after(60):
        async with client(scripted=ids) as http:
            body = chat(logprobs=True, top_logprobs=2)
            done = (await http.post("/v1/chat/completions", json=body)).json()
            tokens = done["choices"][0]["logprobs"]["content"]
            assert b"".join(bytes(t["bytes"]) for t in tokens).decode() == SPLIT
            tops = [t["top_logprobs"][0] for t in tokens]
            assert b"".join(bytes(t["bytes"]) for t in tops).decode() == SPLIT
            streamed = events(await http.post("/v1/chat/completions", json=body | {"stream": True}))
            pieces = [t for c in streamed for t in (c["choices"][0]["logprobs"] or {}).get(
                "content") or []]  # fmt: skip
            assert b"".join(bytes(t["bytes"]) for t in pieces).decode() == SPLIT
