"""What a trainer implements to be served, and the OpenAI-compatible wire types.

Requests are decoded by msgspec into these Structs (unknown fields are ignored, as the
OpenAI API's clients send many); a malformed body, a wrong type or a bad value is a
400 with a JSON error naming the field. corun adds two optional fields to chat
requests — ``episode_id`` and ``group`` — that record the conversation as a training
episode (corun/serve/capture.py); the ``openai`` client sends them with
``extra_body``. Responses carry the sampled token ids, their log-probs and the policy
version that produced them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import msgspec
import torch

Finish = Literal["stop", "length", "tool_calls"]


class ServeError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


# ----------------------------------------------------------------------------- requests


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class ToolSpec(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def key(self) -> tuple[Any, ...]:
        """What identifies the message when a recorded conversation is continued."""
        calls = tuple((c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return self.role, self.content or "", calls


Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
# What torch.Generator.manual_seed takes (a larger int would fail the whole batch).
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    tools: list[ToolSpec] | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    logprobs: bool = False
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    episode_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    group: Annotated[str, msgspec.Meta(max_length=200)] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | Annotated[list[int], msgspec.Meta(min_length=1)]
    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


class RewardReport(msgspec.Struct, kw_only=True):
    reward: float


# ----------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float


@dataclass
class Completion:
    """One generated reply: the sampled ids (the stop token included), their
    behaviour log-probs and the version of each."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Literal["stop", "length"]


@dataclass
class Reply:
    """A reply as the API shows it: text, or tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ServedPolicy(Protocol):
    """What the endpoint needs of a trainer's policy (``Trainer.served_policy()``).

    ``generate`` is blocking (the endpoint runs it on its own compute lane) and reads
    the rollout side's newest published weights, never weights being trained.
    """

    @property
    def name(self) -> str: ...

    @property
    def max_len(self) -> int:
        """Tokens of prompt and reply together."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (ValueError for text the vocabulary cannot hold)."""
        ...

    def encode_message(self, message: ChatMessage) -> list[int]:
        """One chat message as the policy reads it in a conversation (ValueError if the
        policy cannot take it)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token(self, token_id: int) -> str:
        """One token's text (for per-token log-probs)."""
        ...

    def reply(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        """The reply of a generation: a tool call when it is one of ``tools``."""
        ...

    def generate(
        self, prompts: list[list[int]], sampling: Sampling, generator: torch.Generator
    ) -> list[Completion]:
        """Replies to equally long prompts, sampled together."""
        ...
