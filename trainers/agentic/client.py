"""An agent that solves the calculator task through the OpenAI-compatible endpoint: it
asks the policy, runs the calculator when the policy calls it, sends the result back,
and reports the reward of the final answer. Written against plain HTTP (httpx), as any
agent framework's client would talk to the endpoint; the ``episode_id`` makes the
endpoint record the episode for training (corun/serve/capture.py)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx

from trainers.agentic.calculator import Problem, Problems

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "adds two numbers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}}]  # fmt: skip


async def solve(
    http: httpx.AsyncClient, problem: Problem, *, model: str, episode: str | None = None,
    group: str | None = None, temperature: float = 0.5, max_turns: int = 3,
) -> tuple[str, float]:  # fmt: skip
    """The agent's final answer and its reward; with ``episode``, reported for training."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
    answer = ""
    for _ in range(max_turns):
        body: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS,
                                "max_tokens": 10, "temperature": temperature}  # fmt: skip
        if episode is not None:
            body |= {"episode_id": episode, "group": group}
        response = await http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            answer = message["content"] or ""
            break
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                         "content": calculate(calls[0]["function"]["arguments"])})  # fmt: skip
    reward = 1.0 if answer == problem.answer else 0.0
    if episode is not None:
        reported = await http.post(f"/v1/episodes/{episode}/reward", json={"reward": reward})
        reported.raise_for_status()
    return answer, reward


def calculate(arguments: str) -> str:
    """The tool: ``{"expression": "a+b"}`` → ``=<sum>``, or ``!`` for what it cannot add."""
    try:
        left, right = json.loads(arguments)["expression"].split("+")
        return f"={int(left) + int(right)}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "!"


async def practice(
    url: str, *, model: str, problems: int = 8, group: int = 8, seed: int = 1,
    stats: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """Forever: a round of ``problems`` training problems, ``group`` episodes of each at
    once (GRPO compares them), every episode reported for training. An episode cut off
    by the endpoint stopping is skipped."""
    stats = stats if stats is not None else {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for round_index in range(10**9):

            async def episode(problem: Problem, name: str, k: int) -> None:
                try:
                    _, reward = await solve(http, problem, model=model, episode=f"{name}-{k}",
                                            group=name)  # fmt: skip
                except httpx.HTTPError:
                    return
                stats["episodes"] = stats.get("episodes", 0) + 1
                stats["rewards"] = stats.get("rewards", 0.0) + reward

            async with anyio.create_task_group() as episodes:
                for i, problem in enumerate(Problems(problems, seed).batch(round_index)):
                    for k in range(group):
                        episodes.start_soon(episode, problem, f"{seed}-{round_index}-{i}", k)
