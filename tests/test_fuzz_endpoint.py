"""Fuzzing the OpenAI-compatible endpoint (corun/serve/): random JSON bodies, mutated
chat and completion requests (wrong types, huge and negative numbers, unknown roles,
tool calls, episode ids), invalid UTF-8, odd content types, unknown routes and
methods, random bearer tokens, episode sequences with reward reports.

The ASGI app runs in process behind httpx's ``ASGITransport``, on an event loop in a
blocking portal — asyncio and trio, each fuzzed with the same examples — with its real
batcher and the calculator policy (a tiny model), so each example is one request.
Every answer is 2xx, or 4xx with an OpenAI-style JSON error that names the field
(``param``) where a field is wrong; never a 5xx, never a hang, and the endpoint keeps
serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import given, settings
from hypothesis import strategies as st

from corun.execution.compute import Lane
from corun.serve.app import build_app
from corun.serve.batching import Batcher
from corun.serve.capture import Recorder
from tests.support.fuzz_support import FUZZ, count, json_values
from tests.test_endpoint import MODEL, chat, policy

TOKEN = "s3cret"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/episodes/e1/v1/chat/completions",
          "/v1/models", "/health", "/v1/episodes/e1/reward", "/v1/nope", "/",
          "/v1/episodes//reward", "/episodes/e1/v1/models"]  # fmt: skip


@dataclass
class Served:
    portal: BlockingPortal
    open: httpx.AsyncClient  # no token required
    guarded: httpx.AsyncClient  # TOKEN required
    batcher: Batcher

    def send(self, client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
        async def call() -> httpx.Response:
            with anyio.fail_after(20):  # a hang fails the example
                return await client.request(method, url, **kw)

        return self.portal.call(call)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The app on a portal of each backend (module-scoped: one per backend, every
    test of the module on it in turn)."""
    lane = Lane("serve-fuzz")
    served_policy = policy(lane)
    with start_blocking_portal(request.param) as portal:
        batcher = Batcher(served_policy, max_batch=8, wait_s=0.0)
        recorder = Recorder(served_policy, None, ttl_s=600)
        future = portal.start_task_soon(batcher.run)

        def client(token: str) -> httpx.AsyncClient:
            app = build_app(served_policy, batcher, recorder, token)
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

        clients = client(""), client(TOKEN)
        try:
            yield Served(portal, *clients, batcher)
            assert not future.done(), f"the batcher ended: {future.exception()!r}"
        finally:
            for c in clients:
                portal.call(c.aclose)
            future.cancel()
            lane.close()


def check(response: httpx.Response) -> Any:
    """2xx with JSON (or a stream), or 4xx with an OpenAI-style error; never a 5xx."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    count(f"endpoint/answered-{response.status_code}")
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        return None
    body = response.json()
    if response.status_code >= 400:
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], body
        assert set(error) == {"message", "type", "param", "code"}, body
        if response.status_code == 400 and error["message"].startswith("invalid request"):
            # A wrong field is named in param; a body that is no object names none.
            assert error["param"] or "Expected `object`, got" in error["message"], body
    return body


def still_serving(served: Served) -> None:
    check(served.send(served.open, "POST", "/v1/chat/completions", json=chat(max_tokens=2)))


# ----------------------------------------------------------------------------- strategies

numbers = st.sampled_from([0, 1, -1, 48, 2**31, 2**63, 2**64, 2**70, -(2**70), 1e308, 0.5, -0.0])
anything = numbers | json_values
# Content as a list of parts: text (the parts joined) or another kind (refused).
text_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]), "text": st.text("0123456789+=", max_size=6)}
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system", "robot"])},
        optional={
            "content": st.none()
            | st.text(alphabet="0123456789+=()x", max_size=12)
            | anything
            | st.lists(text_parts, max_size=2),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.text(max_size=4),
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.text(max_size=6),
                                "arguments": st.text(max_size=20) | anything,
                            }
                        ),
                    }
                ),
                max_size=2,
            ),
            "tool_call_id": anything,
        },
    ),
    max_size=4,
)
CHAT_FIELDS = ["model", "messages", "tools", "max_tokens", "max_completion_tokens", "temperature",
               "top_p", "stream", "logprobs", "seed", "n", "episode_id", "group", "stop",
               "top_logprobs", "stream_options", "tool_choice", "parallel_tool_calls"]  # fmt: skip
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "stream",
                     "logprobs", "seed", "n"]  # fmt: skip


@st.composite
def mutated_request(draw: st.DrawFn, chat_route: bool) -> dict[str, Any]:
    if chat_route:
        body: dict[str, Any] = chat(max_tokens=3)
        body["messages"] = draw(st.just(body["messages"]) | messages)
    else:
        body = {"model": MODEL, "prompt": draw(st.text("0123456789+=", max_size=8) | anything),
                "max_tokens": 3}  # fmt: skip
    fields = CHAT_FIELDS if chat_route else COMPLETION_FIELDS
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(fields) | st.text(max_size=6))
        if draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(anything)
    return body


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


bodies = st.one_of(
    st.builds(encode, mutated_request(True)),
    st.builds(encode, mutated_request(False)),
    st.builds(encode, json_values),
    st.binary(max_size=40),  # invalid UTF-8, not JSON
    st.builds(
        lambda b, at: encode(b)[:at] + b"\xff\xfe" + encode(b)[at:],
        mutated_request(True),
        st.integers(0, 40),
    ),
    st.sampled_from([b"", b"null", b"NaN", b'{"model": "calc", "messages": [' * 50, b"\x00" * 10]),
)
content_types = st.sampled_from(
    [
        "application/json",
        "text/plain",
        "",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "application/x-www-form-urlencoded",
    ]
)


# ----------------------------------------------------------------------------- tests


@settings(FUZZ, max_examples=300)
@given(route=st.sampled_from(ROUTES[:3]), body=bodies, content_type=content_types)
def test_fuzzed_requests(served: Served, route: str, body: bytes, content_type: str) -> None:
    count("endpoint/requests")
    headers = {"content-type": content_type} if content_type else {}
    check(served.send(served.open, "POST", route, content=body, headers=headers))


@settings(FUZZ, max_examples=60)
@given(
    route=st.sampled_from(ROUTES),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    body=bodies,
    authorization=st.sampled_from(["", f"Bearer {TOKEN}", TOKEN, "Bearer", f"bearer {TOKEN}"])
    | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
)
def test_routes_methods_and_tokens(
    served: Served, route: str, method: str, body: bytes, authorization: str
) -> None:
    count("endpoint/routes-tokens")
    headers = {"authorization": authorization} if authorization else {}
    response = served.send(served.guarded, method, route, content=body, headers=headers)
    check(response)
    if authorization != f"Bearer {TOKEN}" and response.status_code not in (404, 405):
        assert response.status_code == 401, response.text


@settings(FUZZ, max_examples=30)
@given(
    actions=st.lists(
        st.tuples(
            st.sampled_from(["chat", "chat", "reward"]),
            st.sampled_from(["e1", "e2", "é/ü", "x" * 200]),
            st.builds(lambda r: {"reward": r}, numbers | st.floats(allow_nan=False)) | json_values,
        ),
        max_size=6,
    )
)
def test_episode_sequences(served: Served, actions: list[tuple[str, str, Any]]) -> None:
    """Episodes started, continued out of order, rewarded twice or never, with any body."""
    count("endpoint/episode-sequences")
    for action, episode, payload in actions:
        if action == "chat":
            body = chat(max_tokens=2, episode_id=episode, group="g")
            check(served.send(served.open, "POST", "/v1/chat/completions", json=body))
        else:
            url = f"/v1/episodes/{episode}/reward"
            check(served.send(served.open, "POST", url, content=encode(payload)))


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("seed-2**70", "seed", 2**70),  # killed the batcher (torch's manual_seed overflowed)
        ("seed--(2**63)-1", "seed", -(2**63) - 1),
        ("max_tokens-2**70", "max_tokens", 2**70),
        ("temperature-1e308", "temperature", 1e308),
        ("top_p-0", "top_p", 0),
    ],
)
def test_extreme_numbers_are_400_naming_the_field(
    served: Served, name: str, field: str, value: Any
) -> None:
    count("endpoint/extreme-numbers")
    response = served.send(served.open, "POST", "/v1/chat/completions", json=chat(**{field: value}))
    body = check(response)
    assert response.status_code == 400, body
    assert body["error"]["param"] == field, body
    still_serving(served)


@pytest.mark.parametrize("size", [(1 << 20) + 1, 8 << 20])
def test_body_over_the_limit_is_413(served: Served, size: int) -> None:
    count("endpoint/huge-body")
    body = b'{"model": "calc", "messages": [{"role": "user", "content": "' + b"1" * size + b'"}]}'
    response = served.send(served.open, "POST", "/v1/chat/completions", content=body)
    assert response.status_code == 413 and check(response)["error"]["message"]


def test_serving_goes_on_after_the_fuzz(served: Served) -> None:
    still_serving(served)
    assert served.batcher.batches > 0
