"""An agent on the OpenAI-compatible endpoint: it asks the policy, runs its tool when the
policy calls it, sends the result back, and reports the reward of the final answer.
Written against plain HTTP (httpx), as any agent framework's client would talk to the
endpoint; the ``episode_id`` makes the endpoint record the episode for training
(corun/serve/capture.py). The task (its prompts, answers and tool) is the caller's:
trainers/agentic/agent.py is the calculator's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import httpx


class Task(Protocol):
    """One problem for the agent: the user message, and the exact answer that earns 1."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


@dataclass(frozen=True)
class Tool:
    """A function tool the agent offers the policy and runs itself: ``run`` maps a call's
    JSON arguments to the tool message's text."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    run: Callable[[str], str]

    @property
    def spec(self) -> dict[str, Any]:
        """The tool as a request's ``tools`` entry."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters}  # fmt: skip
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Agent:
    """Solves tasks with one tool, ``max_tokens`` per reply."""

    tool: Tool
    max_tokens: int

    async def solve(
        self, http: httpx.AsyncClient, task: Task, *, model: str, episode: str | None = None,
        group: str | None = None, temperature: float = 0.5, max_turns: int = 3,
    ) -> tuple[str, float]:  # fmt: skip
        """The agent's final answer and its reward; with ``episode``, reported for training."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        answer = ""
        for _ in range(max_turns):
            body: dict[str, Any] = {"model": model, "messages": messages,
                                    "tools": [self.tool.spec], "max_tokens": self.max_tokens,
                                    "temperature": temperature}  # fmt: skip
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
            result = self.tool.run(calls[0]["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": result})
        reward = 1.0 if answer == task.answer else 0.0
        if episode is not None:
            reported = await http.post(f"/v1/episodes/{episode}/reward", json={"reward": reward})
            reported.raise_for_status()
        return answer, reward

    async def practice(
        self, url: str, rounds: Callable[[int], Sequence[Task]], *, model: str, name: str,
        group: int = 8, stats: dict[str, float] | None = None,
    ) -> None:  # fmt: skip
        """Forever: round ``i``'s tasks (``rounds(i)``), ``group`` episodes of each at once
        (GRPO compares them), every episode reported for training under the name
        ``<name>-<i>-<task>-<k>``. An episode cut off by the endpoint stopping is skipped.
        ``stats`` counts the episodes and sums their rewards."""
        stats = stats if stats is not None else {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for round_index in range(10**9):

                async def episode(task: Task, group_name: str, k: int) -> None:
                    try:
                        _, reward = await self.solve(http, task, model=model,
                                                     episode=f"{group_name}-{k}",
                                                     group=group_name)  # fmt: skip
                    except httpx.HTTPError:
                        return
                    stats["episodes"] = stats.get("episodes", 0) + 1
                    stats["rewards"] = stats.get("rewards", 0.0) + reward

                async with anyio.create_task_group() as episodes:
                    for i, task in enumerate(rounds(round_index)):
                        for k in range(group):
                            episodes.start_soon(episode, task, f"{name}-{round_index}-{i}", k)
