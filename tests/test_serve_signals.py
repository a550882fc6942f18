"""The endpoint under real signals: ``corun serve`` prints its URL first and stops on
Ctrl-C (exit 130); a ``corun train`` serving 32 agents mid-request stops on Ctrl-C with
every request either complete or failed cleanly, exit 130, and nothing left listening
on the port."""

from __future__ import annotations

import signal
import threading
from typing import Any

import httpx
import pytest

from tests.support.corun_process import CorunRun, assert_interrupted
from tests.test_agentic import TINY

pytestmark = pytest.mark.slow
BODY = {"model": "run", "messages": [{"role": "user", "content": "123+456="}], "max_tokens": 10}


def _closed(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_corun_serve_prints_its_url_and_stops_on_sigint(start_corun: Any) -> None:
    run: CorunRun = start_corun(TINY, command="serve")
    run.wait_until("the URL on stdout", lambda: "corun: serving" in run.stdout())
    first = run.stdout().splitlines()[0]
    url = first.removeprefix("corun: serving ").strip()
    assert first.startswith("corun: serving http://127.0.0.1:")
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "run"
    assert httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30).status_code == 200
    run.send(signal.SIGINT)
    assert run.wait_exit() == 130
    assert "Traceback" not in run.stderr()
    assert _closed(url)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigint_with_32_agents_mid_request(start_corun: Any, backend: str) -> None:
    run: CorunRun = start_corun(
        TINY, run={"steps": 10_000, "backend": backend}, loop={"baseline_eval": False},
        serve={"enabled": True},
    )  # fmt: skip
    run.wait_event("endpoint")
    url = next(e["url"] for e in run.events() if e["event"] == "endpoint")
    outcomes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def agent() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not stop.is_set():
                try:
                    code = http.post("/v1/chat/completions", json=BODY).status_code
                    outcome = "ok" if code == 200 else f"status {code}"
                except httpx.TransportError as exc:
                    outcome = type(exc).__name__  # refused or cut: a clean client error
                with lock:
                    outcomes.append(outcome)
                if outcome != "ok":
                    return

    agents = [threading.Thread(target=agent) for _ in range(32)]
    for thread in agents:
        thread.start()
    run.wait_until("64 answered requests", lambda: outcomes.count("ok") >= 64)
    run.send(signal.SIGINT)
    code = run.wait_exit()
    stop.set()
    for thread in agents:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in agents), "an agent hung"
    events = assert_interrupted(run, code, signal.SIGINT, complete=False)
    teardown = [e["event"] for e in events if e["event"].startswith("teardown:")]
    assert teardown[:2] == ["teardown:stop", "teardown:endpoint"]  # first, before the rest
    assert set(outcomes) <= {"ok", "ConnectError", "RemoteProtocolError", "ReadError",
                             "status 503"}, set(outcomes)  # fmt: skip
    assert _closed(url)
