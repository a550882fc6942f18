"""Fuzzing the Tinker server (corun/serve/tinker/): every route's valid body with fields
replaced by random JSON values or dropped, random JSON and bytes, forward-backward
protobuf bodies cut short or with wrong tensors, unknown routes.

The ASGI app runs in process behind httpx's ``ASGITransport`` on an event loop in a
blocking portal, with its real service and the built-in tiny model's backend, so each
example is one request. Every answer is 2xx, or 4xx with ``{"detail", "category":
"user"}``; a future that fails at once fails as the client's error (``user``), never
the server's; never a 5xx, never a hang, and the server keeps serving.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from corun.base.config import ServeConfig
from corun.contract.config_file import load_config
from corun.engines.options import EngineOptions
from corun.execution.compute import Lane
from corun.recipes import shipped
from corun.serve.tinker.app import build_app
from corun.serve.tinker.service import TinkerService
from tests.support.fuzz_support import FUZZ, count, json_values
from trainers.hf.policy import ChatFormat, load_policy
from trainers.hf.tinker import training_backend

pytestmark = pytest.mark.slow


@dataclass
class Served:
    portal: BlockingPortal
    client: httpx.AsyncClient
    service: TinkerService
    session: str
    model_id: str

    def send(self, method: str, route: str, **kw: Any) -> httpx.Response:
        async def call() -> httpx.Response:
            with anyio.fail_after(30):  # a hang fails the example
                return await self.client.request(method, f"/api/v1/{route}", **kw)

        return self.portal.call(call)

    def wait(self, request_id: str) -> Any:
        """A future's reply, once its work ran (bounded)."""
        future = self.service.futures.get(request_id)
        assert future is not None
        return self.portal.call(future.wait, 60)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    recipe = shipped("tinker")
    assert recipe is not None
    config = load_config(recipe)
    policy, tokenizer = load_policy("tiny-llama", "the fuzzed server's model")
    backend = training_backend(policy, ChatFormat(tokenizer), "local", EngineOptions(), config)
    lane = Lane("tinker-fuzz")
    with tempfile.TemporaryDirectory() as root, start_blocking_portal("asyncio") as portal:
        service = TinkerService(backend, ServeConfig(tinker=True), lane, Path(root))
        running, _ = portal.start_task(service.run)
        app = build_app(service, "")
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        served = Served(portal, client, service, "", "")
        served.session = served.send("POST", "create_session", json={}).json()["session_id"]
        created = served.send("POST", "create_model", json=_create(served.session, 0)).json()
        served.model_id = created["model_id"]
        assert served.wait(created["request_id"]) is not None
        try:
            yield served
            assert not running.done(), f"the service ended: {running.exception()!r}"
        finally:
            portal.call(client.aclose)
            running.cancel()
            portal.call(backend.close)
            lane.close()


def _create(session: str, seq: int) -> dict[str, Any]:
    return {"session_id": session, "model_seq_id": seq, "base_model": "tiny-llama",
            "lora_config": {"rank": 2}}  # fmt: skip


def check(served: Served, response: httpx.Response) -> None:
    """2xx, or 4xx naming the problem as the client's; a future that already failed
    failed as the client's error."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    count(f"tinker/answered-{response.status_code}")
    if response.status_code >= 400:
        body = response.json()
        assert body["category"] == "user" and body["detail"], body
        return
    if response.headers.get("content-type", "").startswith("application/json"):
        request_id = response.json().get("request_id") if response.content else None
        future = served.service.futures.get(request_id) if request_id else None
        if future is not None and future.reply is not None and future.reply.media.endswith("json"):
            reply = json.loads(future.reply.body)
            assert reply.get("category", "user") == "user", reply


# ----------------------------------------------------------------------------- bodies


def valid(served: Served, route: str) -> dict[str, Any]:
    model = {"model_id": served.model_id, "seq_id": 10_000}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 9]}]}
    return {
        "create_model": _create(served.session, 99),
        "optim_step": {**model, "adam_params": {"learning_rate": 1e-3}},
        "save_weights": {**model, "path": "x"},
        "save_weights_for_sampler": {**model, "path": "y"},
        "load_weights": {**model, "path": f"tinker://{served.model_id}/weights/x"},
        "create_sampling_session": {"session_id": served.session, "base_model": "tiny-llama"},
        "asample": {"prompt": prompt, "num_samples": 1, "base_model": "tiny-llama",
                    "sampling_params": {"max_tokens": 2, "seed": 1}},
        "retrieve_future": {"request_id": "req-1"},
        "get_info": {"model_id": served.model_id},
        "weights_info": {"tinker_path": f"tinker://{served.model_id}/weights/x"},
        "client/config": {"sdk_version": "0.38.0"},
    }[route]  # fmt: skip


ROUTES = ["create_model", "optim_step", "save_weights", "save_weights_for_sampler",
          "load_weights", "create_sampling_session", "asample", "retrieve_future", "get_info",
          "weights_info", "client/config"]  # fmt: skip
anything = st.sampled_from([0, -1, 2**31, 2**64, 1e308, -0.5, "", "tinker://a/b/c"]) | json_values


@st.composite
def mutated(draw: st.DrawFn, served: Served) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    body: Any = valid(served, route)
    for _ in range(draw(st.integers(0, 3))):
        named = st.sampled_from(list(body)) if body else st.nothing()
        field = draw(named | st.text(max_size=6))
        if draw(st.integers(0, 3)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(anything)
    if draw(st.integers(0, 5)) == 0:
        body = draw(json_values)
    raw = json.dumps(body).encode()
    return route, draw(st.just(raw) | st.binary(max_size=30)) if draw(st.booleans()) else raw


@settings(FUZZ, max_examples=250)
@given(data=st.data())
def test_fuzzed_json_routes(served: Served, data: st.DataObject) -> None:
    route, body = data.draw(mutated(served))
    count("tinker/requests")
    check(served, served.send("POST", route, content=body))


def _forward_backward(served: Served, tokens: list[int], tensors: dict[str, Any]) -> bytes:
    request = pb.ForwardBackwardRequest(model_id=served.model_id, seq_id=10_000,
                                        loss_fn="cross_entropy")  # fmt: skip
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    for name, (values, dtype, shape) in tensors.items():
        tensor = datum.loss_fn_inputs[name]
        tensor.dense, tensor.dtype = values, dtype
        tensor.shape.extend(shape)
    return bytes(request.SerializeToString())


@settings(FUZZ, max_examples=120)
@given(
    tokens=st.lists(st.integers(-5, 2**31 - 1), max_size=6),
    dtype=st.sampled_from([0, 1, 2, 3, 4, 9]),
    shape=st.lists(st.integers(-2, 8), max_size=3),
    payload=st.binary(max_size=48),
    cut=st.integers(0, 80),
    loss=st.sampled_from(["cross_entropy", "ppo", "dro", ""]),
)
def test_fuzzed_forward_backward_bodies(
    served: Served, tokens: list[int], dtype: int, shape: list[int], payload: bytes, cut: int,
    loss: str,
) -> None:  # fmt: skip
    body = _forward_backward(served, tokens, {"target_tokens": (payload, dtype, shape),
                                              "weights": (payload, 1, shape)})  # fmt: skip
    request = pb.ForwardBackwardRequest()
    request.ParseFromString(body)
    request.loss_fn = loss
    request.seq_id = served.service.models[served.model_id].turns.next  # it runs: its data checked
    body = request.SerializeToString()[: cut or None]
    count("tinker/forward_backward")
    response = served.send("POST", "forward_backward", content=body,
                           headers={"content-type": "application/x-protobuf"})  # fmt: skip
    check(served, response)
    if response.status_code == 200:  # its work ran: a reply, or the client's error
        reply = served.wait(response.json()["request_id"])
        assert reply is not None
        if reply.media.endswith("json"):
            assert json.loads(reply.body)["category"] == "user", reply


def test_still_serving_after_the_fuzz(served: Served) -> None:
    """A model created after the fuzz trains: its first forward-backward succeeds."""
    created = served.send("POST", "create_model", json=_create(served.session, 7)).json()
    assert served.wait(created["request_id"]) is not None
    model_id = created["model_id"]
    tensors = {"target_tokens": (np.asarray([5, 9, 2], "<i8").tobytes(), 2, [3]),
               "weights": (np.ones(3, "<f4").tobytes(), 1, [3])}  # fmt: skip
    served.model_id = model_id
    request = pb.ForwardBackwardRequest()
    request.ParseFromString(_forward_backward(served, [1, 5, 9], tensors))
    request.seq_id = 1
    submitted = served.send("POST", "forward_backward", content=request.SerializeToString())
    reply = served.wait(submitted.json()["request_id"])
    assert reply is not None and reply.media == "application/x-protobuf", reply
