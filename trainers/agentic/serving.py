"""The calculator policy behind the OpenAI-compatible endpoint (corun/serve/).

A conversation reads as the episode runner lays it out: a user message is the
problem's text, an assistant message is its reply and EOS (a tool call renders as
``(a+b)``), a tool message is the calculator's answer at its fixed observation width.
A reply that is a well-formed call becomes a ``calculator`` tool call (arguments
``{"expression": "a+b"}``) when the request offers that tool; anything else is text.
Generation reads the rollout side's newest published weights on the endpoint's own
lane, never the weights being trained; TinyLM samples equally long prompts together, so
a call's prompts are generated a length at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from corun.contract.engine import Generation, TokenSink, deliver
from corun.contract.policy import (
    ChatMessage,
    Completion,
    FunctionCall,
    Reply,
    Sampling,
    ToolCall,
    ToolSpec,
)
from corun.execution.compute import Lane
from trainers.agentic import calculator
from trainers.lm.engine import LocalEngine

TOOL = "calculator"


class CalculatorPolicy:
    def __init__(
        self, name: str, max_len: int, engine: Callable[[], LocalEngine], lane: Lane
    ) -> None:
        self.name = name
        self.max_len = max_len
        self.vocab_size = calculator.VOCAB_SIZE
        self.continuous_batching = False  # one blocking call at a time, on its lane
        self.tool_call_marker = ""  # a whole reply "(a+b)" is a call: nothing to stream early
        self._engine = engine  # the calling thread's copy of the newest weights
        self._lane = lane

    def encode(self, text: str) -> list[int]:
        return calculator.encode(text)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        return [i for message in messages for i in self.encode_message(message)]

    def continuation(
        self, history: Sequence[ChatMessage], new: Sequence[ChatMessage],
        tools: Sequence[ToolSpec], stopped: bool,
    ) -> list[int]:  # fmt: skip
        # Nothing follows a reply but the next messages (a reply's EOS is its own).
        return self.render(new, tools)

    def encode_message(self, message: ChatMessage) -> list[int]:
        """One message as the episode runner lays it out."""
        if message.role == "user":
            return calculator.encode(message.text())
        if message.role == "tool":
            return calculator.encode_observation(message.text())
        if message.role == "assistant":
            calls = message.tool_calls or []
            text = "".join(f"({_expression(c)})" for c in calls) or message.text()
            return [*calculator.encode(text), calculator.EOS]
        raise ValueError("the calculator policy reads user, assistant and tool messages only")

    def decode(self, ids: Sequence[int]) -> str:
        return calculator.decode(ids)

    def token(self, token_id: int) -> str:
        return calculator.VOCABULARY.tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return self.token(token_id).encode()

    def reply(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        text = calculator.decode(ids)
        call = calculator.CALL.fullmatch(text)
        if TOOL in tools and call is not None:
            arguments = json.dumps({"expression": f"{call[1]}+{call[2]}"})
            function = FunctionCall(name=TOOL, arguments=arguments)
            return Reply(None, [ToolCall(id=f"call_{call[1]}_{call[2]}", function=function)])
        return Reply(text)

    async def generate(
        self, prompts: list[list[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None = None,
    ) -> list[Completion]:  # fmt: skip
        """The replies; streamed whole, each to ``sink`` when its call returns."""
        done = await self._lane.run(self._generate, prompts, sampling, seed)
        if sink is not None:
            deliver([Generation(c.ids, c.logprobs, c.versions, c.finish) for c in done], sink)
        return done

    def _generate(
        self, prompts: list[list[int]], sampling: Sampling, seed: int
    ) -> list[Completion]:
        """On the lane: the prompts a length at a time (in order of first appearance),
        every draw from one generator."""
        engine = self._engine()
        generator = torch.Generator(engine.device).manual_seed(seed)  # draws where it samples
        rows: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            rows.setdefault(len(prompt), []).append(row)
        done: dict[int, Completion] = {}
        for group in rows.values():
            out = engine.generate(
                torch.tensor([prompts[row] for row in group]), 1, sampling.max_tokens,
                sampling.temperature, sampling.top_p, generator=generator,
                stop=not sampling.ignore_eos,
            )  # fmt: skip
            for i, row in enumerate(group):
                n = int(out.response_mask[i].sum())
                ids = out.response_ids[i, :n].tolist()
                stopped = bool(ids) and ids[-1] == calculator.EOS and not sampling.ignore_eos
                finish: Literal["stop", "length"] = "stop" if stopped else "length"
                done[row] = Completion(ids, out.logprobs[i, :n].tolist(),
                                       out.token_versions[i, :n].tolist(), finish)  # fmt: skip
        return [done[row] for row in range(len(prompts))]

    def fingerprint(self, version: int) -> str:
        return ""  # not tracked for the calculator's TinyLM


def _expression(call: ToolCall) -> str:
    try:
        return str(json.loads(call.function.arguments)["expression"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"tool call arguments {call.function.arguments!r}: no expression"
        ) from None
