"""An agent that solves the calculator task through the OpenAI-compatible endpoint
(corun.agents.client's, with the calculator as its tool): ``solve`` one problem, or
``practice`` on training problems forever, every episode reported for training."""

from __future__ import annotations

import json

from corun.agents.client import Agent, Tool
from trainers.agentic.calculator import Problems
from trainers.agentic.serving import TOOL


def calculate(arguments: str) -> str:
    """The tool: ``{"expression": "a+b"}`` → ``=<sum>``, or ``!`` for what it cannot add."""
    try:
        left, right = json.loads(arguments)["expression"].split("+")
        return f"={int(left) + int(right)}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "!"


EXPRESSION = {"type": "object", "properties": {"expression": {"type": "string"}}}
# Replies of up to 10 tokens: a call "(123+456)" and EOS, or an answer.
CALCULATOR_AGENT = Agent(Tool(TOOL, "adds two numbers", EXPRESSION, calculate), max_tokens=10)
solve = CALCULATOR_AGENT.solve


async def practice(
    url: str, *, model: str, problems: int = 8, group: int = 8, seed: int = 1,
    stats: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """Forever: a round of ``problems`` training problems (round ``i``: batch ``i`` of
    ``seed``'s problems), ``group`` episodes of each at once."""
    rounds = Problems(problems, seed).batch
    await CALCULATOR_AGENT.practice(
        url, rounds, model=model, name=str(seed), group=group, stats=stats
    )
