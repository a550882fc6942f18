"""A prompt as data gives it: plain text or chat messages. A leaf: the tasks that read
prompts and the chat format that renders them (policy.py) both import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Prompt:
    """A prompt as data gives it: plain text, or chat messages."""

    text: str = ""
    messages: tuple[Message, ...] = ()

    def __str__(self) -> str:
        return self.text or "\n".join(f"{m.role}: {m.content}" for m in self.messages)
