"""What both example services share: a host web API (starlette) that keeps answering
while corun trains in the same process, and the set-up of that training.

The host's API, on http://127.0.0.1:8008 by default:

- ``GET /status``: the training step and policy version, the endpoint's URL, and how
  the host's practising agents are doing;
- ``GET /solve?a=123&b=456``: one of the host's agents solves a sum with the current
  policy (greedy, through the endpoint; not recorded for training).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import corun
from trainers.agentic.agent import practice, solve
from trainers.agentic.calculator import Problem

MODEL = "agentic"
OVERRIDES = [
    "trainer.episodes=submitted",  # train on the episodes the host's agents run
    "serve.enabled=true",
    f"run.name={MODEL}",
    "trainer.env.latency_ms=0",  # (the env serves only the held-out evaluation here)
    # The agents keep running while the trainer trains: their episodes may be a version
    # behind, corrected for.
    "loop.max_staleness=1",
    "trainer.off_policy_correction=decoupled",
    "log.progress=plain",
]


def training_config(run_dir: str) -> corun.Config:
    return corun.load_config("agentic", [*OVERRIDES, f"run.dir={run_dir}"])


def host_api(session: corun.Session, stats: dict[str, float]) -> Starlette:
    async def status(request: Request) -> JSONResponse:
        episodes = stats.get("episodes", 0)
        return JSONResponse({
            "step": session.step, "version": session.version, "endpoint": session.endpoint_url,
            "agent_episodes": episodes,
            "agent_reward_mean": stats.get("rewards", 0.0) / episodes if episodes else None,
        })  # fmt: skip

    async def solve_one(request: Request) -> JSONResponse:
        try:
            problem = Problem(int(request.query_params["a"]), int(request.query_params["b"]))
        except (KeyError, ValueError):
            return JSONResponse({"error": "give ?a=<100..999>&b=<100..999>"}, status_code=400)
        assert session.endpoint_url is not None
        async with httpx.AsyncClient(base_url=session.endpoint_url, timeout=30) as http:
            answer, reward = await solve(http, problem, model=MODEL, temperature=0.0)
        return JSONResponse({"problem": problem.prompt, "answer": answer, "right": reward == 1})

    return Starlette(routes=[Route("/status", status), Route("/solve", solve_one)])


async def main(serve: Any, port: int, run_dir: str) -> None:
    """Train in this event loop while the host serves its API and its agents practise;
    Ctrl-C (or the step budget) ends it, tearing corun down in order."""
    stats: dict[str, float] = {}
    async with corun.training(training_config(run_dir)) as session:
        assert session.endpoint_url is not None
        print(f"host API on http://127.0.0.1:{port} (GET /status, /solve?a=123&b=456); "
              f"policy endpoint {session.endpoint_url}", flush=True)  # fmt: skip
        done = anyio.Event()
        async with anyio.create_task_group() as host:
            host.start_soon(partial(practice, session.endpoint_url, model=MODEL, stats=stats))
            host.start_soon(serve, host_api(session, stats), port, done.wait)

            async def finish() -> None:
                outcome = await session.finished()
                print(f"training ended: {outcome}", flush=True)
                done.set()
                host.cancel_scope.cancel()

            host.start_soon(finish)
