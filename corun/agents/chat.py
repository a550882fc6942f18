"""Chat templates of Hugging Face tokenizers as token ids, for conversations that grow
token for token.

A conversation is rendered once by the model's own chat template (:meth:`ChatTemplate.
render`, OpenAI-shaped messages and ``tools`` in, ids through the generation prompt
out). After that it only grows: the ids a reply sampled, then
:meth:`ChatTemplate.continuation` — the template's text after the reply (``"\\n"``
after an end-of-turn token, say) and the messages that follow, through the next
generation prompt. Nothing already in the transcript is re-tokenized, so what is
trained is exactly what was sampled, even where re-encoding a reply's text would give
other ids (BPE merges across the boundary, say). A template that re-renders earlier
turns when more follow (one that drops old reasoning, say) cannot grow a conversation
this way, and says so (ValueError).

Replies are parsed in the Hermes/Qwen convention: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks become tool calls (:func:`parse_tool_calls`). Also here, for
the endpoint and the episode runners alike: stop strings (:func:`find_stop`) and a
reply's text as one piece per token (:func:`content_pieces`, for streaming).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from corun.contract.policy import ChatMessage, FunctionCall, Reply, ToolCall, ToolSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Decode = Callable[[Sequence[int]], str]


class ChatTemplate:
    """The chat template of ``tokenizer`` over :class:`ChatMessage`s. ``system_prompt``
    (when not empty) opens every conversation that has no system message;
    ``stop_ids`` are end-of-turn ids besides the tokenizer's EOS (a model's
    ``generation_config.json`` may list some: :func:`configured_stop_ids`)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, system_prompt: str = "", *,
        stop_ids: Sequence[int] = (),
    ) -> None:  # fmt: skip
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.eos_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id = self.eos_id if pad is None else int(pad)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *stop_ids]))
        self._stop_texts = [self.token(i) for i in self.stop_ids]

    # ---- rendering
    def messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as chat templates take them (tool call arguments as dicts)."""
        out = [_template_message(m) for m in messages]
        if self.system_prompt and (not out or out[0]["role"] != "system"):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    def text(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), *,
        generation_prompt: bool = True,
    ) -> str:  # fmt: skip
        """The template's text of a conversation (ValueError: it cannot render it)."""
        specs = [msgspec.to_builtins(tool) for tool in tools] or None
        template_messages = self.messages(messages)
        try:
            rendered = self.tokenizer.apply_chat_template(
                template_messages, tools=specs, add_generation_prompt=generation_prompt,
                tokenize=False,
            )  # fmt: skip
        except Exception as exc:  # a template is a program over the request's data: any
            # error it raises (its own, or a TypeError on an odd tool schema) is the input's
            raise ValueError(f"the chat template cannot render the messages ({exc})") from None
        return str(rendered)

    def ids(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added (a template writes those it wants)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """A conversation's ids through the generation prompt."""
        return self.ids(self.text(messages, tools))

    def continuation(
        self, history: Sequence[ChatMessage], new: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (), *, stopped: bool = True,
    ) -> list[int]:  # fmt: skip
        """The ids after the sampled ids of the reply that ends ``history`` through the
        next generation prompt: the template's text after the reply's stop token (the
        stop token first when the reply did not stop: ``stopped`` False), then ``new``."""
        before = self.text(history, tools, generation_prompt=False)
        after = self.text([*history, *new], tools)
        if not after.startswith(before):
            raise ValueError(
                "the chat template re-renders earlier turns when messages follow them, so "
                "the conversation cannot grow token for token"
            )
        return self.ids(self._after_reply(before, stopped) + after[len(before) :])

    def _after_reply(self, text: str, stopped: bool) -> str:
        at, mark = max((text.rfind(stop), stop) for stop in self._stop_texts)
        if at < 0:  # the template writes no stop token after a reply
            return ""
        return text[at + len(mark) :] if stopped else text[at:]

    def reply_ids(
        self, history: Sequence[ChatMessage], reply: ChatMessage, tools: Sequence[ToolSpec] = ()
    ) -> list[int]:
        """What the template writes for the assistant's ``reply`` after
        ``render(history, tools)``, through its stop token (a demonstration's ids)."""
        start = self.text(history, tools)
        full = self.text([*history, reply], tools, generation_prompt=False)
        if not full.startswith(start):
            raise ValueError("the chat template renders a reply unlike its generation prompt")
        ids = self.ids(full[len(start) :])
        end = next((i for i, token in enumerate(ids) if token in self.stop_ids), None)
        return ids[: end + 1] if end is not None else [*ids, self.eos_id]

    # ---- replies
    def parse(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        """A reply: Hermes tool calls when ``tools`` are offered, else text; the content
        without the tool call blocks (None if nothing is left) and without the
        whitespace a template's generation prompt leaves before it (``"assistant:"``
        then ``" 579"``). The transcript keeps the sampled ids whatever the content."""
        text = self.decode(ids)
        calls, rest = parse_tool_calls(text) if tools else ([], text)
        if not calls:
            return Reply(text.lstrip())
        return Reply(rest.strip() or None, calls)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: its text's, unless it holds part of a character (its
        text alone is U+FFFD); then the bytes its vocabulary entry stands for."""
        text = self.token(token_id)
        if "\ufffd" not in text:
            return text.encode()
        raw = vocabulary_bytes(str(self.tokenizer.convert_ids_to_tokens(token_id)))
        return text.encode() if raw is None else raw


def vocabulary_bytes(entry: str) -> bytes | None:
    """The bytes a vocabulary entry stands for, in the two encodings that split a
    character over tokens: SentencePiece's byte fallback (``<0xE2>``) and byte-level
    BPE, which writes each byte as one printable character (GPT-2's alphabet); None for
    an entry in neither."""
    fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", entry)
    if fallback:
        return bytes([int(fallback[1], 16)])
    if entry and all(char in _BYTE_LEVEL for char in entry):
        return bytes(_BYTE_LEVEL[char] for char in entry)
    return None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, character to byte: the printable Latin-1 bytes stand
    for themselves, and the others, in order, for the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + n): b for n, b in enumerate(others)}


_BYTE_LEVEL = _byte_level_alphabet()


def configured_stop_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids a model directory's ``generation_config.json`` lists."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (int(eos),)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    # "developer" is the newer name of "system"; templates know the older one.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(call: ToolCall) -> dict[str, Any]:
    """A call's JSON arguments as a dict, as chat templates expect them."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call {call.function.name!r}: its arguments are no JSON object")
    return arguments


# ----------------------------------------------------------------------------- tool calls

TOOL_CALL_MARKER = "<tool_call>"  # where a Hermes tool call starts
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str]:
    """The well-formed ``<tool_call>`` blocks of ``text`` as tool calls (a last block
    cut off before its closing tag included), and the text without them; a block that
    is no JSON object with a ``name`` and object ``arguments`` stays in the text."""
    calls: list[ToolCall] = []
    kept, pos = [], 0
    for match in TOOL_CALL.finditer(text):
        call = _tool_call(match[1])
        if call is not None:
            calls.append(call)
            kept.append(text[pos : match.start()])
            pos = match.end()
    return calls, "".join([*kept, text[pos:]])


def _tool_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    function = FunctionCall(name=call["name"], arguments=json.dumps(arguments))
    return ToolCall(id=f"call_{secrets.token_hex(12)}", function=function)


# ----------------------------------------------------------------------------- stop strings


@dataclass(frozen=True)
class StopMatch:
    kept: int  # ids kept: through the token that completes the stop string
    text: str  # the reply's text before the stop string


def find_stop(ids: Sequence[int], decode: Decode, stops: Sequence[str]) -> StopMatch | None:
    """Where a reply ends at the first of ``stops`` (None: it contains none): the ids
    through the token that completes the stop string, and the text before it."""
    if not stops or not _has_stop(decode(ids), stops):
        return None
    low, high = 1, len(ids)  # the fewest leading ids whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        if _has_stop(decode(ids[:middle]), stops):
            high = middle
        else:
            low = middle + 1
    text = decode(ids[:low])
    return StopMatch(low, text[: min(text.find(s) for s in stops if s in text)])


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to its first stop string."""
    found = [text.find(s) for s in stops if s in text]
    return text[: min(found)] if found else text


def _has_stop(text: str, stops: Sequence[str]) -> bool:
    return any(stop in text for stop in stops)


# ----------------------------------------------------------------------------- streaming


def content_pieces(ids: Sequence[int], decode: Decode, content: str) -> list[str]:
    """``content`` (a reply's text, from ``ids``) as one piece per token, for streaming:
    each token's share of the text, decoded incrementally (a token ending inside a
    character waits for the next); joined, the pieces are ``content`` exactly (text
    the tokens do not account for comes in the last piece)."""
    if not ids:
        return []
    pieces, prefix, read = [], 0, 0
    for end in range(1, len(ids) + 1):
        before, now = decode(ids[prefix:read]), decode(ids[prefix:end])
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            pieces.append(now[len(before) :])
            prefix, read = read, end
        else:
            pieces.append("")
    if not content[:1].isspace():  # the whitespace parse() drops before a reply's text
        for i, piece in enumerate(pieces):
            pieces[i] = piece.lstrip()
            if pieces[i]:
                break
    out, used = [], 0
    for piece in pieces:  # clipped to the content (a stop string cut it short, say)
        take = _common_prefix(piece, content[used:])
        out.append(take)
        used += len(take)
    out[-1] += content[used:]
    return out


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
