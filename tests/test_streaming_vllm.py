"""Streamed replies on in-process vLLM (corun/engines/vllm_batching.py's sink): the first
content chunk arrives while vLLM is still stepping the request, the deltas joined are
the non-stream reply for the same seed (log-probs included), and a client that leaves
mid-stream has its request aborted in vLLM while another request of the same call runs
to its end. The transformers engine's: tests/test_streaming.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("vllm")

from corun.agents.chat import ChatTemplate
from corun.agents.served import EnginePolicy
from corun.base.config import ServeConfig
from corun.contract.episodes import EpisodeInbox
from corun.engines.options import VLLMConfig
from corun.engines.vllm_engine import VLLMEngine
from corun.execution.compute import Lane
from corun.serve.server import Endpoint
from tests.support.vllm_helpers import Engines
from tests.test_streaming import ask, stream
from trainers.hf.policy import load_policy


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Engines[VLLMEngine]]:
    held = Engines(lambda: VLLMEngine.start(VLLMConfig(model=str(model_dir))), 180)
    yield held
    anyio.run(held.release)


async def endpoint(engine: VLLMEngine, model_dir: Path) -> Endpoint:
    template = ChatTemplate(load_policy(f"hf:{model_dir}", "model")[1])
    policy = EnginePolicy("tiny", engine, template, 256, {}, continuous_batching=True)
    return Endpoint(policy, ServeConfig(enabled=True), Lane("serve"), EpisodeInbox())


@pytest.mark.anyio
async def test_vllm_streams_tokens_as_they_are_generated(
    engines: Engines[VLLMEngine], model_dir: Path, anyio_backend: str
) -> None:
    engine = await engines.get()
    served = await endpoint(engine, model_dir)
    body = ask(max_tokens=48, logprobs=True)
    with anyio.fail_after(120):
        async with served.running() as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]

            async def watched() -> list[tuple[dict[str, Any], int]]:
                chunks = []
                async with http.stream("POST", "/v1/chat/completions",
                                       json=body | {"stream": True}) as r:  # fmt: skip
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunks.append((json.loads(line[6:]), len(engine._batcher._requests)))
                return chunks

            chunks = await watched()
    texts = [c["choices"][0]["delta"].get("content") for c, _ in chunks if c["choices"]]
    assert "".join(t or "" for t in texts) == whole["message"]["content"]
    first = next(i for i, t in enumerate(texts) if t)
    assert chunks[first][1] == 1  # its request was still in vLLM: text came mid-generation
    assert sum(1 for t in texts if t) > len(whole["token_ids"]) / 2
    sent = [t for c, _ in chunks if c["choices"]
            for t in (c["choices"][0]["logprobs"] or {}).get("content") or []]  # fmt: skip
    assert [t["logprob"] for t in sent] == pytest.approx(
        [t["logprob"] for t in whole["logprobs"]["content"]], abs=1e-5
    )


@pytest.mark.anyio
async def test_vllm_aborts_the_request_of_a_client_that_leaves(
    engines: Engines[VLLMEngine], model_dir: Path, anyio_backend: str
) -> None:
    engine = await engines.get()
    served = await endpoint(engine, model_dir)
    with anyio.fail_after(120):
        async with served.running() as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            kept: list[Any] = []
            left = anyio.Event()

            async def leaver() -> None:
                body = ask(max_tokens=200) | {"stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            break
                left.set()

            async def stayer() -> None:
                kept.extend(await stream(http, ask(max_tokens=200)))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(stayer)
                tasks.start_soon(leaver)
                await left.wait()
                with anyio.fail_after(10):  # the leaver's request is aborted, the other runs
                    while len(engine._batcher._requests) != 1:  # noqa: ASYNC110 (vLLM's state)
                        await anyio.sleep(0.01)
                assert not kept  # the other is still streaming: the one gone is the leaver's
            assert kept[-1][0]["choices"][0]["finish_reason"] in ("length", "stop")
            assert engine._batcher._requests == {}  # nothing left in vLLM
            assert (
                await http.post("/v1/chat/completions", json=ask(max_tokens=2))
            ).status_code == 200
