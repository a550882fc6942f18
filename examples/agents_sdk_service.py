"""An asyncio web service whose OpenAI Agents SDK agents practise a tool task while
corun trains their Hugging Face policy in the same process: ``python
examples/agents_sdk_service.py [port]`` from the repository root (the ``openai-agents``
package installed).

The policy is the built-in tiny Llama of configs/hf_agentic.toml (warm-started
by hf_agentic_sft.toml, trained first when missing, ~1 minute). The agents are plain
Agents SDK agents — an ``Agent`` with a ``@function_tool`` calculator on
``OpenAIChatCompletionsModel`` — that know nothing of corun but their base URL: each
episode gets its own, ``<endpoint>/episodes/<id>/v1``, so the endpoint records it
token for token, and the agent reports the reward of its answer to
``POST <endpoint>/v1/episodes/<id>/reward``. Rounds of 8 training problems, 8 episodes
each (a GRPO group: the episodes of one problem are compared), are what the run trains
on (``trainer.episodes = "submitted"``).

The host's API, on http://127.0.0.1:8010 by default:

- ``GET /status``: the training step and policy version, the endpoint's URL, and how
  the agents are doing — episodes, mean reward and success (all, and the last 256);
- ``GET /solve?a=123&b=456``: an agent solves a sum with the current policy (greedy;
  not recorded for training).

Ctrl-C stops it: the host's server shuts down, the agents stop, and corun tears the run
down in order.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import deque
from pathlib import Path
from typing import Any

import agents
import anyio
import httpx
import openai
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from the repository root
import corun
from examples.asyncio_service import serve_host
from trainers.agentic.calculator import Problem, Problems, answer_reward

MODEL = "hf_agentic"  # the recipe's run.name: the served model's name
GROUP = 8  # episodes per problem: the recipe's samples_per_prompt
OVERRIDES = [
    "trainer.episodes=submitted",  # train on the episodes the agents run
    "serve.enabled=true",
    # The agents keep playing while the trainer trains: their episodes may be a
    # version behind, corrected for.
    "loop.max_staleness=1",
    "trainer.off_policy_correction=decoupled",
    "loop.eval_interval=0",  # the agents' reward is the measure here
    "log.progress=plain",
]


def training_config(run_dir: str) -> corun.Config:
    return corun.load_config("hf_agentic", [*OVERRIDES, f"run.dir={run_dir}"])


@agents.function_tool
def calculator(expression: str) -> str:
    """Adds two numbers: an expression "a+b"."""
    left, plus, right = expression.partition("+")
    if plus and left.strip().isdigit() and right.strip().isdigit():
        return str(int(left) + int(right))
    return "error: give an expression a+b"


class Agents:
    """The host's agents: each episode an Agents SDK run on its own base URL."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # One client (and connection pool); each episode a copy with its base URL. No
        # retries: a request retried after the endpoint took it would not continue the
        # episode it recorded (a 409), and a local endpoint that fails is stopping.
        self.client = openai.AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="unused",
                                         max_retries=0)  # fmt: skip
        self.http = httpx.AsyncClient(base_url=endpoint, timeout=120)
        self.rewards: deque[float] = deque(maxlen=256)
        self.episodes, self.total, self.successes = 0, 0.0, 0

    def agent(self, base_url: str, temperature: float) -> agents.Agent[Any]:
        model = agents.OpenAIChatCompletionsModel(
            model=MODEL, openai_client=self.client.with_options(base_url=base_url)
        )
        settings = agents.ModelSettings(temperature=temperature, max_tokens=96)
        return agents.Agent(name="adder", tools=[calculator], model=model,
                            model_settings=settings)  # fmt: skip

    async def solve(self, problem: Problem, base_url: str, temperature: float) -> str:
        """The agent's final answer ("" when it gave none: too many turns, a call of a
        tool it does not have — the SDK's ModelBehaviorError — a conversation longer
        than the model takes, or the endpoint gone)."""
        agent = self.agent(base_url, temperature)
        try:
            result = await agents.Runner.run(agent, f"What is {problem.a}+{problem.b}?",
                                             max_turns=3)  # fmt: skip
        except (agents.AgentsException, openai.APIError):
            return ""  # (an APIError: too long a conversation, or the endpoint stopping)
        return str(result.final_output).strip()

    async def episode(self, problem: Problem, name: str) -> None:
        answer = await self.solve(problem, f"{self.endpoint}/episodes/{name}/v1", 0.7)
        reward = answer_reward(problem.answer, answer)
        try:
            reported = await self.http.post(f"/v1/episodes/{name}/reward",
                                            json={"reward": reward})  # fmt: skip
        except httpx.HTTPError:  # the endpoint stopped (the run ended)
            return
        if reported.status_code != 200:  # no reply recorded (its first request failed)
            return
        self.episodes += 1
        self.total += reward
        self.successes += reward == 1
        self.rewards.append(reward)

    async def practice(self) -> None:
        """Forever: a round of 8 training problems, ``GROUP`` episodes of each at once."""
        problems = Problems(8, seed=1)
        for round_index in range(10**9):
            async with anyio.create_task_group() as episodes:
                for i, problem in enumerate(problems.batch(round_index)):
                    for k in range(GROUP):
                        episodes.start_soon(self.episode, problem, f"r{round_index}-{i}-{k}")

    def status(self) -> dict[str, Any]:
        recent = list(self.rewards)
        return {
            "agent_episodes": self.episodes,
            "agent_reward_mean": self.total / self.episodes if self.episodes else None,
            "agent_success": self.successes / self.episodes if self.episodes else None,
            "recent_reward_mean": sum(recent) / len(recent) if recent else None,
            "recent_success": sum(r == 1 for r in recent) / len(recent) if recent else None,
        }


def host_api(session: corun.Session, pool: Agents) -> Starlette:
    async def status(request: Request) -> JSONResponse:
        return JSONResponse({"step": session.step, "version": session.version,
                             "endpoint": session.endpoint_url, **pool.status()})  # fmt: skip

    async def solve_one(request: Request) -> JSONResponse:
        try:
            problem = Problem(int(request.query_params["a"]), int(request.query_params["b"]))
        except (KeyError, ValueError):
            return JSONResponse({"error": "give ?a=<100..999>&b=<100..999>"}, status_code=400)
        answer = await pool.solve(problem, f"{pool.endpoint}/v1", 0.0)  # not recorded
        return JSONResponse({"problem": f"{problem.a}+{problem.b}", "answer": answer,
                             "right": answer == problem.answer})  # fmt: skip

    return Starlette(routes=[Route("/status", status), Route("/solve", solve_one)])


async def main(port: int, run_dir: str) -> None:
    """Train in this event loop while the host serves its API and its agents practise,
    until the step budget or Ctrl-C: then the host's server shuts down gracefully, the
    agents stop, and leaving ``corun.training`` stops the run (its teardown, in order,
    with the save an interrupt makes)."""
    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    async with corun.training(training_config(run_dir)) as session:
        assert session.endpoint_url is not None
        pool = Agents(session.endpoint_url)
        print(f"host API on http://127.0.0.1:{port} (GET /status, /solve?a=123&b=456); "
              f"policy endpoint {session.endpoint_url}", flush=True)  # fmt: skip
        done = anyio.Event()
        async with pool.client, pool.http, anyio.create_task_group() as host:
            practising = anyio.CancelScope()

            async def practise() -> None:
                with practising:
                    await pool.practice()

            host.start_soon(practise)
            host.start_soon(serve_host, host_api(session, pool), port, done.wait)
            await until_done_or_interrupted(session)
            done.set()  # (the server shuts down itself: cancelling it mid-serve is noisy)
            practising.cancel()
        print(f"agents: {pool.status()}", flush=True)


async def until_done_or_interrupted(session: corun.Session) -> None:
    """Wait for the run's step budget, or Ctrl-C (SIGINT) or SIGTERM."""
    async with anyio.create_task_group() as either:

        async def finished() -> None:
            print(f"training ended: {await session.finished()}", flush=True)
            either.cancel_scope.cancel()

        async def interrupted() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for received in signals:
                    print(f"{signal.Signals(received).name}: stopping", flush=True)
                    either.cancel_scope.cancel()

        either.start_soon(finished)
        either.start_soon(interrupted)


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8010
    try:
        asyncio.run(main(port, "runs/example-agents-sdk"))
    except KeyboardInterrupt:  # a second Ctrl-C, while stopping
        pass
    print("stopped", flush=True)
