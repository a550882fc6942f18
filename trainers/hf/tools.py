"""The calculator task as a chat function tool, for Hugging Face chat policies.

The problems are the TinyLM agentic task's (trainers/agentic/calculator.py: sums of two
3-digit numbers, one in ten held out by a stable hash); here they are a conversation.
The user asks "What is 123+456?", and the policy, offered the function tool
``calculator(expression: str)``, calls it in its chat template's convention
(``<tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>``
for Hermes/Qwen-style templates and the built-in tiny model), reads the tool message
with the sum, and answers in text.

The environment reuses the TinyLM task's calculator (its latency and long tail,
``[trainer.env]``) and scoring: a call with a well-formed ``a+b`` expression gets a
tool message with the sum; a malformed call, an unknown tool or arguments that are no
JSON object get an error tool message (the episode goes on, ``rollout/tool_errors``);
a reply without tool calls is the final answer, scored 1 when it is exactly the sum
and 0.5 × the share of digits in place otherwise (partial credit gives RL a gradient
early). An episode succeeds when it ends with the exact sum (reward 1).
:func:`practice` is an agent that solves the problems through the endpoint with the
same tool, its episodes captured for training (``trainer.episodes = "submitted"``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from corun import stable_seed
from corun.agents.chat_runner import ChatStep
from corun.agents.client import Agent, Tool
from corun.contract.policy import ChatMessage, FunctionCall, FunctionSpec, ToolCall, ToolSpec
from trainers.agentic.calculator import (
    CALL,
    CalculatorEnv,
    EnvSettings,
    Problem,
    Problems,
    answer_reward,
    eval_problems,
)
from trainers.agentic.serving import TOOL
from trainers.hf.chat_tasks import ChatTask

CALCULATOR = ToolSpec(
    function=FunctionSpec(
        name=TOOL,
        description="Adds two numbers",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    )
)
TOOLS = [CALCULATOR]
TOOL_ERROR = "error: give an expression a+b"


def question(problem: Problem) -> str:
    return f"What is {problem.a}+{problem.b}?"


def first_messages(problem: Problem, system_prompt: str = "") -> list[ChatMessage]:
    """The conversation's start: the question (after the system prompt, if any)."""
    system = [ChatMessage(role="system", content=system_prompt)] if system_prompt else []
    return [*system, ChatMessage(role="user", content=question(problem))]


def tool_call(expression: str, call_id: str = "call_0") -> ToolCall:
    arguments = json.dumps({"expression": expression})
    return ToolCall(id=call_id, function=FunctionCall(name=TOOL, arguments=arguments))


def tool_message(content: str, call: ToolCall) -> ChatMessage:
    return ChatMessage(role="tool", content=content, tool_call_id=call.id, name=TOOL)


def demonstration(problem: Problem, system_prompt: str = "") -> list[ChatMessage]:
    """The ideal episode: ask, call the calculator, read the sum, answer with it."""
    call = tool_call(f"{problem.a}+{problem.b}")
    return [
        *first_messages(problem, system_prompt),
        ChatMessage(role="assistant", tool_calls=[call]),
        tool_message(problem.answer, call),
        ChatMessage(role="assistant", content=problem.answer),
    ]


def expression(call: ToolCall) -> str | None:
    """The ``expression`` argument of a calculator call (None: another tool, or
    arguments that are no JSON object with a string expression)."""
    return _expression(call.function.arguments) if call.function.name == TOOL else None


def _expression(arguments: str) -> str | None:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    value = parsed.get("expression") if isinstance(parsed, dict) else None
    return value.strip() if isinstance(value, str) else None


def calculate(arguments: str) -> str:
    """The calculator as an agent runs it (corun.agents.client): a call's JSON
    arguments → the tool message's text, as the environment writes it."""
    call = CALL.fullmatch(f"({_expression(arguments) or ''})")
    return TOOL_ERROR if call is None else str(int(call[1]) + int(call[2]))


class CalculatorChatEnv:
    """One episode's environment: the problem, and the calculator behind its latency."""

    tools: Sequence[ToolSpec] = TOOLS

    def __init__(self, settings: EnvSettings, seed: int, system_prompt: str = "") -> None:
        self._calculator = CalculatorEnv(settings, seed)  # its latency and its parsing
        self.system_prompt = system_prompt

    async def reset(self, task: Problem) -> list[ChatMessage]:
        await self._calculator.reset(task)
        return first_messages(task, self.system_prompt)

    async def step(self, reply: ChatMessage) -> ChatStep:
        problem = self._calculator.problem
        assert problem is not None, "reset() first"
        if not reply.tool_calls:
            return ChatStep([], answer_reward(problem.answer, reply.text().strip()), done=True)
        results, errors = [], False
        for call in reply.tool_calls:
            # The TinyLM task's calculator: waits its latency, then "=<sum>" or "!".
            step = await self._calculator.step(f"({expression(call) or ''})")
            errors |= step.tool_error
            content = TOOL_ERROR if step.tool_error else step.observation.removeprefix("=")
            results.append(tool_message(content, call))
        return ChatStep(results, tool_call=True, tool_error=errors)


class CalculatorTask(ChatTask):
    """The built-in chat task (``trainer.task = "calculator"``): the problems, and a
    calculator environment per episode whose seed only times the tool."""

    tools = TOOLS

    def dataset(self, batch_size: int) -> Problems:
        return Problems(batch_size, self.seed)

    def eval_tasks(self, n: int) -> list[Problem]:
        return eval_problems(n)

    def make_env(self, index: int, row: int, settings: EnvSettings) -> CalculatorChatEnv:
        seed = stable_seed("env", self.seed, index, row)
        return CalculatorChatEnv(settings, seed, self.system_prompt)

    def demonstration(self, task: Problem) -> list[ChatMessage]:
        return demonstration(task, self.system_prompt)


# ----------------------------------------------------------------------------- an agent


@dataclass(frozen=True)
class Question:
    """A problem as an agent asks it (a corun.agents.client Task)."""

    prompt: str
    answer: str


FUNCTION = CALCULATOR.function
CHAT_CALCULATOR_AGENT = Agent(
    Tool(TOOL, FUNCTION.description, FUNCTION.parameters, calculate), max_tokens=96
)


async def practice(
    url: str, *, model: str, problems: int = 8, group: int = 8, seed: int = 1,
    stats: dict[str, float] | None = None,
) -> None:  # fmt: skip
    """Forever: an agent solving training problems through the endpoint (round ``i``:
    batch ``i`` of ``seed``'s problems, ``group`` episodes of each at once), every
    episode reported for training (``trainer.episodes = "submitted"``)."""

    def questions(index: int) -> list[Question]:
        return [Question(question(p), p.answer) for p in Problems(problems, seed).batch(index)]

    await CHAT_CALCULATOR_AGENT.practice(
        url, questions, model=model, name=str(seed), group=group, stats=stats
    )
