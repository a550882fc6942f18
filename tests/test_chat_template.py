"""Chat templates as token ids (corun/agents/chat.py) on the built-in tiny model's
tokenizer: its template renders plain chats byte for byte as the first one did, and
renders tools, tool calls and tool messages; a conversation grows token for token
(the rendered prompt, the sampled ids, the continuation) to exactly the template's
own ids, and keeps sampled ids the tokenizer would have merged differently; Hermes
tool calls are parsed; stop strings cut a reply after the token that completes them;
a reply streams as one piece per token."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corun.agents.chat import ChatTemplate, content_pieces, find_stop, parse_tool_calls
from corun.contract.policy import (
    ChatMessage,
    FunctionCall,
    FunctionSpec,
    TextPart,
    ToolCall,
    ToolSpec,
)
from trainers.hf.tiny import built_in

# The tiny model's first template, for plain system/user/assistant chats.
FIRST_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CALCULATOR = ToolSpec(function=FunctionSpec(name="calculator", parameters={
    "type": "object", "properties": {"expression": {"type": "string"}}}))  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built_in())


@pytest.fixture(scope="module")
def chat(tokenizer: Any) -> ChatTemplate:
    return ChatTemplate(tokenizer)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def call(expression: str, arguments: str | None = None) -> ChatMessage:
    arguments = arguments or json.dumps({"expression": expression})
    function = FunctionCall(name="calculator", arguments=arguments)
    return ChatMessage(role="assistant", tool_calls=[ToolCall(id="c1", function=function)])


def tool(text: str) -> ChatMessage:
    return ChatMessage(role="tool", content=text, tool_call_id="c1")


CHATS = [
    [user("Ann has 12 pens.")],
    [ChatMessage(role="system", content="be brief"), user("Ann has 12 pens.")],
    [user("Ann has 12 pens."), ChatMessage(role="assistant", content="19"), user("and?")],
]


@pytest.mark.parametrize("messages", CHATS)
def test_plain_chats_render_as_the_first_template_did(
    tokenizer: Any, chat: ChatTemplate, messages: list[ChatMessage]
) -> None:
    dicts = chat.messages(messages)
    for prompt in (True, False):
        first = tokenizer.apply_chat_template(
            dicts, chat_template=FIRST_TEMPLATE, add_generation_prompt=prompt, tokenize=False
        )
        assert chat.text(messages, generation_prompt=prompt) == first


def test_tools_tool_calls_and_tool_messages(chat: ChatTemplate) -> None:
    text = chat.text([user("12+7?"), call("12+7"), tool("19")], [CALCULATOR])
    assert text == (
        'tools: calculator(expression)\nuser: 12+7?\nassistant: <tool_call>{"name": '
        '"calculator", "arguments": {"expression": "12+7"}}</tool_call></s>\n'
        "tool: 19\nassistant:"
    )
    parts = [TextPart(type="text", text="12"), TextPart(type="text", text="+7?")]
    content = ChatMessage(role="user", content=parts)
    assert chat.render([content]) == chat.render([user("12+7?")])  # text parts joined
    with pytest.raises(ValueError, match="no JSON object"):
        chat.render([user("x"), call("", arguments="12+7")])


@pytest.mark.parametrize("stopped", [True, False])
@pytest.mark.parametrize("reply", [ChatMessage(role="assistant", content="19"), call("12+7")])
def test_a_conversation_grows_to_the_templates_own_ids(
    chat: ChatTemplate, reply: ChatMessage, stopped: bool
) -> None:
    """prompt + sampled + continuation == render(the whole conversation), token for
    token, when the reply's ids are the template's own (with or without its EOS)."""
    history, new = [user("Ann has 12 pens.")], [tool("19"), user("and?")]
    prompt = chat.render(history, [CALCULATOR])
    sampled = chat.reply_ids(history, reply, [CALCULATOR])
    assert sampled[-1] == chat.eos_id
    sampled = sampled if stopped else sampled[:-1]
    follow = chat.continuation([*history, reply], new, [CALCULATOR], stopped=stopped)
    assert follow[: 1 - stopped] == ([] if stopped else [chat.eos_id])
    whole = chat.render([*history, reply, *new], [CALCULATOR])
    assert prompt + sampled + follow == whole


def test_sampled_ids_are_kept_where_the_tokenizer_would_merge_them(chat: ChatTemplate) -> None:
    """A reply sampled a character at a time (BPE would merge ' pens'): the transcript
    keeps those ids; only the text after it is the template's."""
    history = [user("Ann has 12 pens.")]
    prompt = chat.render(history)
    vocabulary = chat.tokenizer.get_vocab()
    sampled = [vocabulary[t] for t in ["Ġ", "p", "e", "n", "s"]]  # ' pens', a byte at a time
    sampled.append(chat.eos_id)
    reply = ChatMessage(role="assistant", content="pens")  # the template writes " pens</s>"
    assert chat.reply_ids(history, reply) != sampled  # re-encoding would merge them
    follow = chat.continuation([*history, reply], [user("and?")])
    transcript = prompt + sampled + follow
    assert transcript[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert chat.tokenizer.decode(transcript) == chat.text([*history, reply, user("and?")])
    assert transcript != chat.render([*history, reply, user("and?")])


def test_a_template_that_re_renders_earlier_turns_is_refused(tokenizer: Any) -> None:
    marked = FIRST_TEMPLATE.replace(
        "{{ m['role'] }}:", "{{ m['role'] }}{% if loop.last %}*{% endif %}:"
    )
    copy = tokenizer.__class__.from_pretrained(built_in())
    copy.chat_template = marked
    chat = ChatTemplate(copy)
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        chat.continuation([user("a"), ChatMessage(role="assistant", content="b")], [user("c")])


def test_hermes_tool_calls_are_parsed(chat: ChatTemplate) -> None:
    ids = chat.reply_ids([user("12+7?")], call("12+7"), [CALCULATOR])
    reply = chat.parse(ids, ["calculator"])
    assert reply.content is None and len(reply.tool_calls) == 1
    assert reply.tool_calls[0].function.name == "calculator"
    assert json.loads(reply.tool_calls[0].function.arguments) == {"expression": "12+7"}
    assert chat.parse(ids, []).tool_calls == []  # no tools offered: text
    text = 'I will add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
    calls, rest = parse_tool_calls(text + '</tool_call> <tool_call>{"oops"</tool_call>')
    assert [c.function.name for c in calls] == ["calculator"]
    assert rest == 'I will add.  <tool_call>{"oops"</tool_call>'  # a malformed block stays
    assert len(parse_tool_calls(text)[0]) == 1  # cut off before its closing tag


def test_stop_strings_and_streamed_pieces(chat: ChatTemplate) -> None:
    ids = chat.ids(" Ann has 12 pens. Bob has 3.")
    match = find_stop(ids, chat.decode, ["pens", "Bob"])
    assert match is not None and match.text == " Ann has 12 "
    assert chat.decode(ids[: match.kept]).endswith("pens")  # through the completing token
    assert find_stop(ids, chat.decode, ["Carl"]) is None
    pieces = content_pieces(ids, chat.decode, chat.decode(ids))
    assert len(pieces) == len(ids) and "".join(pieces) == chat.decode(ids)
    cut = content_pieces(ids[: match.kept], chat.decode, match.text)
    assert "".join(cut) == match.text
