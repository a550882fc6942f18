"""Multi-turn tool episodes for chat policies (any Hugging Face model with a chat
template), token-in/token-out.

A chat environment speaks messages: ``reset(task)`` gives the conversation's first
messages, ``step(reply)`` answers the policy's reply (an assistant message with text or
tool calls) with the next messages — tool results, a user turn — and a reward. The
runner turns them into token transcripts the way the model reads them, once:

- the prompt is the chat template's rendering of the first messages with the tools
  (``render``);
- each turn appends the ids the engine SAMPLED (trained, with their behaviour log-probs
  and versions), parsed into the reply message (``parse``) but never re-tokenized;
- the environment's messages are appended as the template's ids that follow those
  sampled ids through the next generation prompt (``continuation``: untrained).

Episodes run in lockstep by turn: one engine ``generate`` over every active transcript
(lengths may differ: an HF engine left-pads them and skips the padding in positions,
so no fillers are needed), then every environment step at once, each under the step
timeout (a slow tool holds up only its own episode's next turn). An environment that
raises or hangs ends its own episode ("failed", "timeout"), never the run; a turn
limit or the model's length ends it as "turn_limit" or "token_limit", as in
runner.py. :func:`teacher_episode` lays out a demonstration conversation exactly as
the runner lays out an episode (SFT on tool use).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

import anyio
import torch

from corun.agents.runner import guarded
from corun.contract.engine import Generation, Sampling
from corun.contract.episodes import Episode
from corun.contract.policy import ChatMessage, Reply, ToolSpec
from corun.contract.trainer import RolloutContext


class ChatStep(NamedTuple):
    """A chat environment's answer to one reply."""

    messages: list[ChatMessage]  # what comes next (tool results, a user turn); unread once done
    reward: float = 0.0  # this turn's reward; an episode's reward is the sum
    done: bool = False
    tool_call: bool = False  # the reply called a tool ...
    tool_error: bool = False  # ... that could not be run (malformed, unknown tool)


class ChatEnvironment(Protocol):
    """One episode's environment, in messages. One with an ``async def aclose()`` has
    it called once the rollout's episodes have all ended."""

    @property
    def tools(self) -> Sequence[ToolSpec]: ...

    async def reset(self, task: Any) -> list[ChatMessage]: ...

    async def step(self, reply: ChatMessage) -> ChatStep: ...


class ChatCodec(Protocol):
    """What the runner needs of a chat template (corun/agents/chat.py's ChatTemplate)."""

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """A conversation's ids through the generation prompt."""
        ...

    def continuation(
        self, history: Sequence[ChatMessage], new: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (), *, stopped: bool = True,
    ) -> list[int]:  # fmt: skip
        """The ids after the last reply's sampled ids, through the next generation prompt."""
        ...

    def reply_ids(
        self, history: Sequence[ChatMessage], reply: ChatMessage, tools: Sequence[ToolSpec] = ()
    ) -> list[int]:
        """The ids the template writes for ``reply`` (through its stop token)."""
        ...

    def parse(self, ids: Sequence[int], tools: Sequence[str]) -> Reply: ...


# An engine's generate (corun/contract/engine.py), or a greedy decode for evaluation:
# one continuation per prompt (prompts of any lengths), all draws from the seed.
Generate = Callable[[list[list[int]], Sampling, int], Awaitable[list[Generation]]]


@dataclasses.dataclass
class _Conversation:
    """One episode's messages so far, beside its token transcript."""

    env: ChatEnvironment
    tools: list[ToolSpec]
    messages: list[ChatMessage] = dataclasses.field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools]


async def run_chat_episodes(
    ctx: RolloutContext, envs: Sequence[ChatEnvironment], tasks: Sequence[Any],
    generate: Generate, template: ChatCodec, sampling: Sampling, *, max_turns: int,
    max_len: int, step_timeout_s: float,
) -> list[Episode]:  # fmt: skip
    """Run one episode per (environment, task) to its end; ``sampling.max_tokens`` is
    the tokens of one turn (its stop token included)."""
    episodes = [Episode(prompt_ids=[]) for _ in envs]
    talks = [_Conversation(env, []) for env in envs]
    async with anyio.create_task_group() as tg:
        for i in range(len(envs)):
            tg.start_soon(_reset, ctx, template, talks[i], tasks[i], episodes[i], step_timeout_s, i)
    active = [i for i, e in enumerate(episodes) if e.status == "done"]  # reset went well
    for turn in range(max_turns):
        active = _with_room(episodes, active, max_len)
        if not active:
            break
        room = min(max_len - episodes[i].length for i in active)
        turn_sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))
        transcripts = [episodes[i].prompt_ids + episodes[i].ids for i in active]
        # From the run's seeded stream, on its generator's device (the CPU: any device's
        # run draws the same seeds); the engine samples with it on its own.
        seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator,
                                 device=ctx.generator.device))  # fmt: skip
        with ctx.span("turn", ctx.track, turn=turn, episodes=len(active)):
            generations = await generate(transcripts, turn_sampling, seed)
        replies = [_record_turn(episodes[i], talks[i], template, g)
                   for i, g in zip(active, generations, strict=True)]  # fmt: skip
        steps = await _step_all(ctx, [(episodes[i], talks[i].env, i) for i in active], replies,
                                step_timeout_s)  # fmt: skip
        last_turn = turn == max_turns - 1
        active = [
            i for row, i in enumerate(active)
            if _observe(episodes[i], talks[i], template, steps[row], generations[row], last_turn,
                        max_len)
        ]  # fmt: skip
    await _close_all(envs)
    return episodes


async def _close_all(envs: Sequence[ChatEnvironment]) -> None:
    """End every episode's environment that has an ``aclose()`` (optional: one that holds
    a session, e.g. corun/agents/openenv.py's, which an episode cut at its turn or
    token limit would otherwise leave open)."""
    async with anyio.create_task_group() as tg:
        for env in envs:
            aclose = getattr(env, "aclose", None)
            if aclose is not None:
                tg.start_soon(aclose)


async def _reset(
    ctx: RolloutContext, template: ChatCodec, talk: _Conversation, task: Any, episode: Episode,
    timeout_s: float, row: int,
) -> None:  # fmt: skip
    messages = await guarded(ctx, episode, functools.partial(talk.env.reset, task), timeout_s, row)
    if messages is None:
        episode.reason = f"reset: {episode.reason}"
        return
    talk.tools, talk.messages = list(talk.env.tools), list(messages)
    try:
        episode.prompt_ids = template.render(talk.messages, talk.tools)
    except ValueError as exc:  # the template cannot take the environment's messages
        episode.status, episode.reason = "failed", f"reset: ValueError: {exc}"


async def _step_all(
    ctx: RolloutContext, going: list[tuple[Episode, ChatEnvironment, int]],
    replies: list[ChatMessage], timeout_s: float,
) -> list[ChatStep | None]:  # fmt: skip
    """Every going episode's environment step at once (None: it failed or timed out)."""
    steps: list[ChatStep | None] = [None] * len(going)

    async def step(row: int) -> None:
        episode, env, i = going[row]
        call = functools.partial(env.step, replies[row])
        steps[row] = await guarded(ctx, episode, call, timeout_s, i)

    async with anyio.create_task_group() as tg:
        for row in range(len(going)):
            tg.start_soon(step, row)
    return steps


def _with_room(episodes: list[Episode], active: list[int], max_len: int) -> list[int]:
    """The active episodes with room for a turn (a token and the stop token); the others
    end at the token limit."""
    going = []
    for i in active:
        if max_len - episodes[i].length < 2:
            episodes[i].status = "token_limit"
        else:
            going.append(i)
    return going


def _record_turn(
    episode: Episode, talk: _Conversation, template: ChatCodec, generation: Generation
) -> ChatMessage:
    """Append a turn's sampled ids to ``episode`` (trained); the reply as a message."""
    episode.add_turn(generation.ids, generation.logprobs, generation.versions, 0, 0)
    reply = template.parse(generation.ids, talk.tool_names)
    message = ChatMessage(role="assistant", content=reply.content,
                          tool_calls=reply.tool_calls or None)  # fmt: skip
    talk.messages.append(message)
    return message


def _observe(
    episode: Episode, talk: _Conversation, template: ChatCodec, step: ChatStep | None,
    generation: Generation, last_turn: bool, max_len: int,
) -> bool:  # fmt: skip
    """Book a step's outcome; append its messages' ids (untrained) when a turn follows.
    Whether the episode goes on."""
    if step is None:  # the environment failed or timed out: the episode is over
        return False
    episode.reward += step.reward
    episode.tool_calls += step.tool_call
    episode.tool_errors += step.tool_error
    if step.done:
        episode.status = "done"
        return False
    try:
        seen = template.continuation(
            talk.messages, step.messages, talk.tools, stopped=generation.finish == "stop"
        )
    except ValueError as exc:  # the template cannot take the environment's messages
        episode.status, episode.reason = "failed", f"ValueError: {exc}"
        return False
    if last_turn or episode.length + len(seen) + 2 > max_len:
        # No turn would follow: the observation would be read by nobody.
        episode.status = "turn_limit" if last_turn else "token_limit"
        return False
    episode.add_observation(seen)
    talk.messages += step.messages
    return True


def teacher_episode(
    template: ChatCodec, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()
) -> Episode:
    """A demonstration conversation as the runner would have recorded it: the messages
    before the first assistant message rendered as the prompt, each assistant message
    as the template writes it (trained, through its stop token), the messages between
    as continuations (untrained)."""
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    history = list(messages[:first])
    episode = Episode(prompt_ids=template.render(history, tools))
    new: list[ChatMessage] = []
    for message in messages[first:]:
        if message.role != "assistant":
            new.append(message)
            continue
        if new:
            episode.add_observation(template.continuation(history, new, tools, stopped=True))
            history += new
            new = []
        ids = template.reply_ids(history, message, tools)
        episode.add_turn(ids, [0.0] * len(ids), [0] * len(ids), 0, 0)
        history.append(message)
    return episode
