"""The calculator policy behind the OpenAI-compatible endpoint (corun/serve/).

A conversation reads as the episode runner lays it out: a user message is the
problem's text, an assistant message is its reply and EOS (a tool call renders as
``(a+b)``), a tool message is the calculator's answer at its fixed observation width.
A reply that is a well-formed call becomes a ``calculator`` tool call (arguments
``{"expression": "a+b"}``) when the request offers that tool; anything else is text.
Generation reads the rollout side's newest published weights from the endpoint's own
lane, never the weights being trained.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from corun.contract.policy import (
    ChatMessage,
    Completion,
    FunctionCall,
    Reply,
    Sampling,
    ToolCall,
)
from trainers.agentic import calculator
from trainers.lm.engine import LocalEngine

TOOL = "calculator"


class CalculatorPolicy:
    def __init__(self, name: str, max_len: int, engine: Callable[[], LocalEngine]) -> None:
        self.name = name
        self.max_len = max_len
        self.vocab_size = calculator.VOCAB_SIZE
        self._engine = engine  # the calling thread's copy of the newest weights

    def encode(self, text: str) -> list[int]:
        return calculator.encode(text)

    def encode_message(self, message: ChatMessage) -> list[int]:
        if message.role == "user":
            return calculator.encode(message.content or "")
        if message.role == "tool":
            return calculator.encode_observation(message.content or "")
        if message.role == "assistant":
            calls = message.tool_calls or []
            text = "".join(f"({_expression(c)})" for c in calls) or message.content or ""
            return [*calculator.encode(text), calculator.EOS]
        raise ValueError("the calculator policy reads user, assistant and tool messages only")

    def decode(self, ids: Sequence[int]) -> str:
        return calculator.decode(ids)

    def token(self, token_id: int) -> str:
        return calculator.VOCABULARY.tokens[token_id]

    def reply(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        text = calculator.decode(ids)
        call = calculator.CALL.fullmatch(text)
        if TOOL in tools and call is not None:
            arguments = json.dumps({"expression": f"{call[1]}+{call[2]}"})
            function = FunctionCall(name=TOOL, arguments=arguments)
            return Reply(None, [ToolCall(id=f"call_{call[1]}_{call[2]}", function=function)])
        return Reply(text)

    def generate(
        self, prompts: list[list[int]], sampling: Sampling, generator: torch.Generator
    ) -> list[Completion]:
        engine = self._engine()
        out = engine.generate(
            torch.tensor(prompts), 1, sampling.max_tokens, sampling.temperature,
            sampling.top_p, generator=generator,
        )  # fmt: skip
        completions = []
        for row in range(len(prompts)):
            n = int(out.response_mask[row].sum())
            ids = out.response_ids[row, :n].tolist()
            stopped = bool(ids) and ids[-1] == calculator.EOS
            finish: Literal["stop", "length"] = "stop" if stopped else "length"
            completions.append(Completion(
                ids, out.logprobs[row, :n].tolist(), out.token_versions[row, :n].tolist(), finish
            ))  # fmt: skip
        return completions


def _expression(call: ToolCall) -> str:
    try:
        return str(json.loads(call.function.arguments)["expression"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"tool call arguments {call.function.arguments!r}: no expression"
        ) from None
