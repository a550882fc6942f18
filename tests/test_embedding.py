"""corun embedded in a host service (``corun.training``), on asyncio and trio: the host
keeps answering its own requests while training runs; cancelling the host's scope
tears the run down in the documented order and re-raises; no signal handler changes
and no thread is left. A host agent pool trains the tool task through the endpoint
(trajectory capture) and learns; 32 agents mid-request at a host cancel get complete
responses or clean errors, and nothing is left listening."""

from __future__ import annotations

import math
import signal
import threading
from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest

import corun
from corun.records.checkpoint import list_checkpoints
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import TEARDOWN_ORDER
from tests.test_agentic import REPO, TINY
from trainers.agentic.agent import practice
from trainers.agentic.sft import AgenticSFTTrainer

pytestmark = pytest.mark.anyio
SFT = {"kind": "sft", "task": "sort", "d_model": 32, "n_heads": 2, "eval_size": 16}


def _lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("corun-lane")}


@pytest.fixture
def earlier_lanes() -> set[threading.Thread]:
    """Lane threads already running: an earlier test in this process may have left one
    in a stuck call on purpose (tests/test_deadlines.py); they are not this test's."""
    return _lane_threads()


def _lanes(earlier: set[threading.Thread]) -> list[str]:
    """This test's lane threads still running."""
    return sorted(t.name for t in _lane_threads() - earlier)


async def test_host_keeps_serving_then_cancels(
    tmp_path: Path, anyio_backend: str, earlier_lanes: set[threading.Thread]
) -> None:
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    config = make_config(tmp_path, SFT, run={"steps": 500}, loop={"eval_interval": 50})
    answered: list[int] = []
    send, receive = anyio.create_memory_object_stream[int](100)
    with anyio.fail_after(120):
        with anyio.CancelScope() as host:
            async with anyio.create_task_group() as service:

                async def answer_requests() -> None:  # the host's own work
                    async for request in receive:
                        answered.append(request)

                async def make_requests() -> None:
                    for i in range(10_000):
                        await send.send(i)
                        await anyio.sleep(0.002)

                service.start_soon(answer_requests)
                service.start_soon(make_requests)
                async with corun.training(config) as session:
                    await session.wait_for_version(20)
                    during = len(answered)
                    host.cancel()
                    await anyio.sleep_forever()
    assert host.cancelled_caught  # the cancellation reached the host, re-raised by corun
    assert during > 20  # the host answered while corun trained 20 steps
    events = [e["event"] for e in read_records(tmp_path / "events.jsonl")]
    teardown = [e for e in events if e.startswith("teardown:")]
    assert teardown == [s for s in TEARDOWN_ORDER if s in teardown] and events[-1] == "end"
    assert read_records(tmp_path / "events.jsonl")[-1]["reason"] == "cancelled"
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert _lanes(earlier_lanes) == []


@pytest.mark.parametrize("serving", [False, True])
async def test_leaving_the_block_stops_the_run(
    tmp_path: Path, anyio_backend: str, serving: bool, earlier_lanes: set[threading.Thread]
) -> None:
    # Serving too: the endpoint's stop once let a cancellation escape into the run's
    # task group on asyncio, and the save on the way out was lost.
    trainer, serve = (TINY, {"enabled": True}) if serving else (SFT, {})
    config = make_config(
        tmp_path, trainer, run={"steps": 500}, loop={"baseline_eval": False}, serve=serve
    )
    with anyio.fail_after(60):
        async with corun.training(config) as session:
            await session.wait_for_version(3)
        assert session.outcome is not None and session.outcome.reason == "interrupted"
    assert list_checkpoints(tmp_path)[-1][0] == session.outcome.step  # saved on the way
    assert _lanes(earlier_lanes) == []


# ----------------------------------------------------------------------------- agents


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # learning is no backend's business
async def test_host_agents_train_the_tool_task_through_the_endpoint(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The SFT warm start, then 30 GRPO steps on episodes that a host's agents ran
    through the endpoint (8 problems x 8 episodes a step, recorded token for token):
    held-out success rises by more than 3 standard errors, as configs/agentic.toml's
    does (measured: 0.645 -> 0.99)."""
    sft = corun.load_config(REPO / "configs/agentic_sft.toml",
                            [f"run.dir={tmp_path / 'sft'}", "log.progress=off"])  # fmt: skip
    warm = tmp_path / "sft" / "checkpoints" / "step-35"
    config = corun.load_config(REPO / "configs/agentic.toml", [
        f"run.dir={tmp_path / 'rl'}", f"trainer.init_from={warm}", "run.steps=30",
        "loop.eval_interval=30", "log.progress=off", "trainer.episodes=submitted",
        "serve.enabled=true", "run.name=agentic", "loop.max_staleness=1",
        "trainer.off_policy_correction=decoupled",
    ])  # fmt: skip
    with anyio.fail_after(300):
        await corun.run(AgenticSFTTrainer(sft), sft)
        async with anyio.create_task_group() as agents:
            async with corun.training(config) as session:
                assert session.endpoint_url is not None
                agents.start_soon(partial(practice, session.endpoint_url, model="agentic"))
                await session.finished()
            agents.cancel_scope.cancel()
    evals = [r for r in read_records(tmp_path / "rl" / "metrics.jsonl") if "eval/success" in r]
    before, after = evals[0]["eval/success"], evals[-1]["eval/success"]
    se = math.sqrt(before * (1 - before) / config.trainer.eval_size)
    print(f"held-out success {before:.3f} -> {after:.3f} (se {se:.3f})")
    assert after - before > 3 * se, (before, after, se)
    endpoint = [
        e for e in read_records(tmp_path / "rl" / "events.jsonl") if e["event"] == "endpoint"
    ]
    assert endpoint[0]["url"] == session.endpoint_url


async def test_32_agents_mid_request_at_a_host_cancel(
    tmp_path: Path, anyio_backend: str, earlier_lanes: set[threading.Thread]
) -> None:
    """Every request either completes or fails cleanly (an HTTP error, no hang), and
    after the teardown nothing listens on the port."""
    config = make_config(tmp_path, {**TINY, "episodes": "submitted"}, run={"steps": 1000},
                         loop={"baseline_eval": False}, serve={"enabled": True})  # fmt: skip
    outcomes = {"ok": 0, "error": 0}
    enough = anyio.Event()

    async def agent(http: httpx.AsyncClient) -> None:
        body = {"model": "run", "messages": [{"role": "user", "content": "123+456="}],
                "max_tokens": 10}  # fmt: skip
        while True:
            try:
                response = await http.post("/v1/chat/completions", json=body)
                outcomes["ok" if response.status_code == 200 else "error"] += 1
                if outcomes["ok"] >= 64:
                    enough.set()
            except httpx.HTTPError:
                outcomes["error"] += 1
                await anyio.sleep(0.01)

    with anyio.fail_after(60):
        with anyio.CancelScope() as host:
            async with corun.training(config) as session:
                url = session.endpoint_url
                assert url is not None
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    async with anyio.create_task_group() as agents:
                        for _ in range(32):
                            agents.start_soon(agent, http)
                        await enough.wait()
                        host.cancel()
    assert host.cancelled_caught and outcomes["ok"] >= 64
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            await http.get("/health")
    assert _lanes(earlier_lanes) == []
