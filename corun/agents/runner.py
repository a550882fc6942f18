"""Many episodes in flight per rollout, token-in/token-out.

A rollout runs its episodes in lockstep by turn: one generation call for every
episode still going (batched, on the rollout worker's compute lane), then every
environment step at once (each awaits its tool on the event loop, under the step
timeout, so a slow tool holds up nothing but its own episode's next turn), then the
observations, and the next turn.

Batching needs the transcripts of a turn to be equally long, so the ids a turn
sampled are followed by PAD up to the longest reply of the turn, and observations
come at a fixed width. Those fillers stay in the episode (untrained): the model is
trained on exactly the tokens it sampled from. A malformed tool call is the
environment's business (an error observation); an environment that raises or hangs
past ``step_timeout_s`` ends its own episode ("failed", "timeout"), never the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import anyio
import torch
from torch import Tensor

from corun.contract.episodes import Environment, Episode, Step
from corun.contract.trainer import RolloutContext

T = TypeVar("T")


class Generated(NamedTuple):
    """One turn of every episode still going: ``tokens[i, :lengths[i]]`` were sampled
    (the stop token included); the rest of the row is filler."""

    tokens: Tensor  # (A, W)
    logprobs: Tensor  # (A, W) behaviour log-probs
    versions: Tensor  # (A, W) the version that produced each token
    lengths: Tensor  # (A,)


# (transcripts (A, L), max new tokens) → the turn; blocking, run on a compute lane. The
# transcripts are built on the CPU: the function takes them to its model's device.
TurnFn = Callable[[Tensor, int], Generated]


class Codec(NamedTuple):
    """Text ↔ ids for one policy's vocabulary."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    encode_observation: Callable[[str], list[int]]
    pad: int


async def run_episodes(
    ctx: RolloutContext, envs: Sequence[Environment], tasks: Sequence[Any], generate: TurnFn,
    codec: Codec, *, max_turns: int, turn_tokens: int, max_len: int, step_timeout_s: float,
) -> list[Episode]:  # fmt: skip
    """Run one episode per (environment, task) to its end."""
    failures: dict[int, str] = {}
    prompts: list[list[int]] = [[] for _ in envs]

    async def reset(i: int) -> None:
        try:
            with anyio.fail_after(step_timeout_s):
                prompts[i] = codec.encode(await envs[i].reset(tasks[i]))
        except Exception as exc:  # as in a step: this episode fails, the others go on
            failures[i] = f"reset: {type(exc).__name__}: {exc}"

    async with anyio.create_task_group() as tg:
        for i in range(len(envs)):
            tg.start_soon(reset, i)
    width = max(len(p) for p in prompts)  # prompts are left-padded to one length
    episodes = [Episode(prompt_ids=[codec.pad] * (width - len(p)) + p) for p in prompts]
    for i, reason in failures.items():
        episodes[i].status, episodes[i].reason = "failed", reason
    active = [i for i in range(len(episodes)) if i not in failures]
    for turn in range(max_turns):
        room = max_len - episodes[active[0]].length if active else 0
        if room < 2:
            for i in active:
                episodes[i].status = "token_limit"
            return episodes
        transcripts = torch.tensor([episodes[i].prompt_ids + episodes[i].ids for i in active])
        with ctx.span("turn", ctx.track, turn=turn, episodes=len(active)):
            out = await ctx.compute(generate, transcripts, min(turn_tokens, room))
        lists = _Lists(*(values.tolist() for values in out))  # to the CPU once a turn
        replies = [_record_turn(episodes[i], lists, row, codec) for row, i in enumerate(active)]
        steps: list[Step | None] = [None] * len(active)
        async with anyio.create_task_group() as tg:
            for row, i in enumerate(active):
                tg.start_soon(_step, ctx, envs[i], replies[row], episodes[i], steps, row,
                              step_timeout_s)  # fmt: skip
        going = []
        last_turn = turn == max_turns - 1
        for row, i in enumerate(active):
            step, episode = steps[row], episodes[i]
            if step is None:  # the environment failed or timed out: the episode is over
                continue
            episode.reward += step.reward
            if step.done:
                episode.status = "done"
                continue
            seen = codec.encode_observation(step.observation)
            if last_turn or episode.length + len(seen) + 2 > max_len:
                # No turn would follow: the observation would be read by nobody.
                episode.status = "turn_limit" if last_turn else "token_limit"
                continue
            episode.add_observation(seen)
            going.append(i)
        _pad_observations([episodes[i] for i in going], codec.pad)
        active = going
    return episodes


class _Lists(NamedTuple):
    """A :class:`Generated` turn as lists: episodes are lists, so a turn's results come
    from the policy's device in one copy each, not row by row."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    lengths: list[int]


def _record_turn(episode: Episode, out: _Lists, row: int, codec: Codec) -> str:
    """Append a turn's sampled tokens (and its fillers) to ``episode``; its reply text."""
    n = out.lengths[row]
    ids = out.tokens[row][:n]
    fillers = len(out.tokens[row]) - n
    episode.add_turn(ids, out.logprobs[row][:n], out.versions[row][:n], fillers, codec.pad)
    return codec.decode(ids)


async def _step(
    ctx: RolloutContext, env: Environment, reply: str, episode: Episode,
    steps: list[Step | None], row: int, timeout_s: float,
) -> None:  # fmt: skip
    step = await guarded(ctx, episode, functools.partial(env.step, reply), timeout_s, row)
    if step is not None:
        steps[row] = step
        episode.tool_calls += step.tool_call
        episode.tool_errors += step.tool_error


async def guarded(
    ctx: RolloutContext, episode: Episode, call: Callable[[], Awaitable[T]], timeout_s: float,
    row: int,
) -> T | None:  # fmt: skip
    """``await call()`` — an environment's reset or step — under ``timeout_s``, its wait
    added to the episode's ``env_wait_s``; when it raises or times out, the episode ends
    ("failed", "timeout" with the reason) and the result is None."""
    started = time.monotonic()
    try:
        with ctx.span("env", f"{ctx.track}/episode-{row}", turn=episode.turns):
            with anyio.fail_after(timeout_s):
                result = await call()
    except TimeoutError:
        episode.status, episode.reason = "timeout", f"environment step took over {timeout_s} s"
        return None
    except Exception as exc:  # the environment's failure ends its episode, not the run
        episode.status, episode.reason = "failed", f"{type(exc).__name__}: {exc}"
        return None
    finally:
        episode.env_wait_s += time.monotonic() - started
    return result


def _pad_observations(episodes: Sequence[Episode], pad: int) -> None:
    """Give the episodes still going one length again (observations may differ)."""
    longest = max((e.length for e in episodes), default=0)
    for episode in episodes:
        if episode.length < longest:
            episode.add_observation([pad] * (longest - episode.length))
