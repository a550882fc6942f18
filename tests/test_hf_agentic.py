"""Multi-turn tool episodes with a Hugging Face chat policy: the calculator as a chat
function tool; the chat episode runner on the tiny model's own chat template (an
episode's trained tokens are exactly the sampled ids, the tool results are the
template's continuation, a demonstration is laid out as the runner lays out an
episode, environments that fail or hang end only their episode); the SFT warm start
then GRPO and PPO end to end on the transformers engine (behaviour log-probs recomputed
exactly, so the masks and positions are right; every batch names the verified weights
that sampled it); and learning from the warm start."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import torch

import corun
from corun.agents.chat import ChatTemplate
from corun.agents.chat_runner import ChatStep, run_chat_episodes, teacher_episode
from corun.contract.engine import Generation, Sampling
from corun.contract.policy import ChatMessage, FunctionCall, ToolCall
from corun.engines import continuous
from corun.records.events import read_records
from tests.support.config import make_config
from trainers.agentic.calculator import EnvSettings, Problem
from trainers.hf.agentic import episode_rollouts
from trainers.hf.policy import load_policy
from trainers.hf.tiny import built_in
from trainers.hf.tools import (
    TOOL_ERROR,
    TOOLS,
    CalculatorChatEnv,
    demonstration,
    first_messages,
    practice,
    tool_call,
    tool_message,
)
from trainers.lm.policy import rollout_logprobs

REPO = Path(__file__).resolve().parents[1]
PROBLEM = Problem(123, 456)


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(built_in()))


def _assistant(*calls: ToolCall, content: str | None = None) -> ChatMessage:
    return ChatMessage(role="assistant", content=content, tool_calls=list(calls) or None)


# ----------------------------------------------------------------------------- the tool


@pytest.mark.anyio
async def test_calculator_tool_answers_calls_errors_and_answers(anyio_backend: str) -> None:
    env = CalculatorChatEnv(EnvSettings(latency_ms=5.0), seed=0)
    with anyio.fail_after(5):
        first = await env.reset(PROBLEM)
        good = await env.step(_assistant(tool_call("123+456", "c1")))
        malformed = await env.step(_assistant(tool_call("123+")))
        other = ToolCall(id="c2", function=FunctionCall(name="search", arguments="{}"))
        unknown = await env.step(_assistant(other))
        no_json = ToolCall(id="c3", function=FunctionCall(name="calculator", arguments="12"))
        broken = await env.step(_assistant(no_json))
        right = await env.step(_assistant(content=" 579"))
        partial = await env.step(_assistant(content="570"))
    assert [(m.role, m.text()) for m in first] == [("user", "What is 123+456?")]
    assert good == ChatStep([good.messages[0]], tool_call=True)
    assert (good.messages[0].text(), good.messages[0].tool_call_id) == ("579", "c1")
    for step in (malformed, unknown, broken):
        assert step.tool_call and step.tool_error and not step.done
        assert step.messages[0].text() == TOOL_ERROR
    assert right == ChatStep([], 1.0, done=True)
    assert partial.done and partial.reward == pytest.approx(0.5 * 2 / 3)


# ----------------------------------------------------------------------------- the runner


def scripted(turns: list[list[int]], stop_id: int) -> Any:
    """An engine's generate that replies turn ``t``'s ids to every prompt, each token
    with log-prob -0.5 and version ``t + 1``; it records the prompts it was given."""
    prompts_seen: list[list[list[int]]] = []

    async def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        ids = turns[len(prompts_seen)][: sampling.max_tokens]
        prompts_seen.append(prompts)
        finish: Literal["stop", "length"] = "stop" if ids and ids[-1] == stop_id else "length"
        turn = len(prompts_seen)
        return [Generation(ids, [-0.5] * len(ids), [turn] * len(ids), finish) for _ in prompts]

    generate.prompts = prompts_seen  # type: ignore[attr-defined]
    return generate


def _ctx() -> corun.RolloutContext:
    return corun.RolloutContext(0, torch.Generator().manual_seed(0))


@pytest.mark.anyio
async def test_runner_trains_exactly_the_sampled_ids(
    template: ChatTemplate, anyio_backend: str
) -> None:
    """Replaying a demonstration's replies gives the demonstration's own layout (what
    SFT trains on), the sampled ids trained and nothing else, each with its log-prob
    and version; every turn's prompt is the transcript so far, never re-tokenized."""
    conversation = demonstration(PROBLEM)
    expected = teacher_episode(template, conversation, TOOLS)
    call_ids = template.reply_ids(conversation[:1], conversation[1], TOOLS)
    answer_ids = template.reply_ids(conversation[:3], conversation[3], TOOLS)
    generate = scripted([call_ids, answer_ids], template.eos_id)
    envs = [CalculatorChatEnv(EnvSettings(), seed=row) for row in range(2)]
    with anyio.fail_after(10):
        episodes = await run_chat_episodes(
            _ctx(), envs, [PROBLEM, PROBLEM], generate, template, Sampling(96, 1.0), max_turns=3,
            max_len=256, step_timeout_s=5.0,
        )  # fmt: skip
    for episode in episodes:
        assert (episode.status, episode.reward, episode.turns, episode.tool_calls) == (
            "done", 1.0, 2, 1,
        )  # fmt: skip
        assert episode.prompt_ids == expected.prompt_ids and episode.ids == expected.ids
        assert episode.trained == expected.trained
        sampled = [i for i, t in zip(episode.ids, episode.trained, strict=True) if t]
        assert sampled == call_ids + answer_ids
        trained_lp = {lp for lp, t in zip(episode.logprobs, episode.trained, strict=True) if t}
        rows = zip(episode.logprobs, episode.versions, episode.trained, strict=True)
        untrained = [(lp, v) for lp, v, t in rows if not t]
        assert trained_lp == {-0.5} and set(untrained) == {(0.0, -1)}
        assert episode.versions[: len(call_ids)] == [1] * len(call_ids)
    ids = episodes[0].ids
    assert generate.prompts[1][0] == episodes[0].prompt_ids + ids[: -len(answer_ids)]
    observation = template.decode(ids[len(call_ids) : -len(answer_ids)])
    assert observation.strip() == "tool: 579\nassistant:"


class Broken:
    """A calculator environment that raises or hangs at its first step."""

    tools = TOOLS

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.inner = CalculatorChatEnv(EnvSettings(), seed=0)

    async def reset(self, task: Problem) -> list[ChatMessage]:
        return await self.inner.reset(task)

    async def step(self, reply: ChatMessage) -> ChatStep:
        if self.mode == "raise":
            raise RuntimeError("the sandbox died")
        if self.mode == "hang":
            await anyio.sleep_forever()
        return await self.inner.step(reply)


@pytest.mark.anyio
async def test_episodes_end_alone_at_failures_and_limits(
    template: ChatTemplate, anyio_backend: str
) -> None:
    call_ids = template.reply_ids(demonstration(PROBLEM)[:1], demonstration(PROBLEM)[1], TOOLS)
    modes = ["raise", "hang", "ok"]
    envs = [Broken(mode) for mode in modes]
    with anyio.fail_after(10):
        episodes = await run_chat_episodes(
            _ctx(), envs, [PROBLEM] * 3, scripted([call_ids], template.eos_id), template,
            Sampling(96, 1.0), max_turns=1, max_len=256, step_timeout_s=0.2,
        )  # fmt: skip
        short = await run_chat_episodes(
            _ctx(), [Broken("ok")], [PROBLEM], scripted([call_ids] * 3, template.eos_id),
            template, Sampling(96, 1.0), max_turns=3, max_len=140, step_timeout_s=5.0,
        )  # fmt: skip
    assert [e.status for e in episodes] == ["failed", "timeout", "turn_limit"]
    assert "the sandbox died" in episodes[0].reason and not episodes[0].trainable
    assert all(e.trained == [True] * len(call_ids) for e in episodes)
    # 49 prompt + 85 sampled + 13 of the tool result: no room for another turn.
    assert (short[0].status, short[0].turns) == ("token_limit", 1)


class ToolEveryTurn:
    """Whatever the policy replies, a tool result follows; the second reply ends it."""

    tools = TOOLS

    def __init__(self) -> None:
        self.replies = 0

    async def reset(self, task: Problem) -> list[ChatMessage]:
        return first_messages(task)

    async def step(self, reply: ChatMessage) -> ChatStep:
        self.replies += 1
        if self.replies == 2:
            return ChatStep([], 1.0, done=True)
        return ChatStep([tool_message("579", tool_call("123+456"))], tool_call=True)


@pytest.mark.anyio
async def test_trained_tokens_recompute_to_their_behaviour_log_probs(anyio_backend: str) -> None:
    """Episodes of a real model, prompts of different lengths, a tool result between
    the turns: as one batch (prompts left-padded, the tool result attended but masked
    out of the loss) the trainer's log-probs of the sampled tokens are the sampler's."""
    policy, tokenizer = load_policy("tiny-llama", "test")
    chat = ChatTemplate(tokenizer)

    async def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        return continuous.generate(policy, prompts, sampling, torch.Generator().manual_seed(seed),
                               chat.pad_id)  # fmt: skip

    problems = [Problem(123, 456), Problem(7, 8), Problem(1234, 5678)]
    with anyio.fail_after(30):
        episodes = await run_chat_episodes(
            _ctx(), [ToolEveryTurn() for _ in problems], problems, generate, chat,
            Sampling(6, 1.0, stop_ids=chat.stop_ids), max_turns=2, max_len=256,
            step_timeout_s=5.0,
        )  # fmt: skip
    assert [e.status for e in episodes] == ["done"] * 3
    assert len({len(e.prompt_ids) for e in episodes}) == 3
    rollouts = episode_rollouts(episodes, chat.pad_id, 0)
    assert rollouts.prompt_mask is not None
    observed = ~rollouts.response_mask & (rollouts.response_ids != chat.pad_id)
    assert observed.sum() >= 3 * len(chat.ids("tool: 579"))  # in the rows, not trained
    with torch.no_grad():
        logp, _, _ = rollout_logprobs(policy, rollouts, 1.0)
    mask = rollouts.response_mask
    torch.testing.assert_close(logp[mask], rollouts.logprobs[mask], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- end to end

SFT = {"kind": "hf_agentic_sft", "model": "tiny-llama", "eval_size": 4, "lr": 3e-3,
       "max_new_tokens": 96}  # fmt: skip
RL = {"model": "tiny-llama", "samples_per_prompt": 2, "eval_size": 4, "max_new_tokens": 96,
      "temperature": 1.0}  # fmt: skip


def _warm_start(tmp_path: Path) -> tuple[corun.Config, str]:
    """Four SFT steps on demonstrations, and where their checkpoint will be."""
    sft = make_config(
        tmp_path / "sft", SFT, run={"steps": 4, "seed": 1},
        loop={"baseline_eval": False, "eval_interval": 4}, data={"batch_size": 4},
    )  # fmt: skip
    return sft, str(tmp_path / "sft/checkpoints/step-4")


@pytest.mark.parametrize("kind", ["hf_agentic", "hf_agentic_ppo"])
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_sft_then_rl_end_to_end(tmp_path: Path, kind: str, anyio_backend: str) -> None:
    """A few SFT steps on demonstrations, then RL from them: episodes run, the behaviour
    log-probs are recomputed exactly (observations attended but not trained, positions
    past the left padding), every step names the verified weights that sampled it."""
    sft, warm = _warm_start(tmp_path)
    rl = make_config(
        tmp_path / "rl", {"kind": kind, **RL, "init_from": warm}, run={"steps": 2, "seed": 1},
        loop={"eval_interval": 2}, data={"batch_size": 2},
    )  # fmt: skip
    with anyio.fail_after(120):
        for config in (sft, rl):
            await corun.run(corun.resolve_trainer(config.trainer.kind)(config), config)
    evals = [r for r in read_records(tmp_path / "sft/metrics.jsonl") if "eval/success" in r]
    assert {"eval/success", "eval/reward", "eval/tool_calls_mean"} <= evals[-1].keys()
    records = read_records(tmp_path / "rl/metrics.jsonl")
    first = next(r for r in records if "train/kl" in r)
    assert first["train/kl"] < 1e-6  # recomputed = behaviour log-probs on the same weights
    assert {"rollout/success", "rollout/turns_mean", "rollout/tool_calls_mean"} <= first.keys()
    events = read_records(tmp_path / "rl/events.jsonl")
    syncs = {e["version"]: e["weights"] for e in events if e["event"] == "sync"}
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2 and all(len(e["weights"]) == 16 for e in steps)
    assert steps[1]["weights"] == syncs[steps[1]["rollout_version"]]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_agents_through_the_endpoint_train_it(tmp_path: Path, anyio_backend: str) -> None:
    """``episodes = "submitted"``: a host's agents solve problems through the endpoint,
    whose capture hands the episodes to the trainer; their behaviour log-probs (the
    engine's, at the agents' temperature) are recomputed exactly."""
    sft, warm = _warm_start(tmp_path)
    rl = make_config(
        tmp_path / "rl",
        {"kind": "hf_agentic", **RL, "init_from": warm, "episodes": "submitted",
         "temperature": 0.5},
        run={"steps": 2, "seed": 1, "name": "calc"}, data={"batch_size": 2},
        loop={"baseline_eval": False, "eval_interval": 2}, serve={"enabled": True},
    )  # fmt: skip
    stats: dict[str, float] = {}
    with anyio.fail_after(120):
        await corun.run(corun.resolve_trainer("hf_agentic_sft")(sft), sft)
        async with anyio.create_task_group() as agents:
            async with corun.training(rl) as session:
                assert session.endpoint_url is not None
                agents.start_soon(partial(practice, session.endpoint_url, model="calc",
                                          problems=2, group=2, stats=stats))  # fmt: skip
                await session.finished()
            agents.cancel_scope.cancel()
    assert stats["episodes"] >= 8
    records = read_records(tmp_path / "rl/metrics.jsonl")
    first = next(r for r in records if "train/kl" in r)
    assert first["train/kl"] < 1e-6 and first["rollout/turns_mean"] >= 1
    steps = [e for e in read_records(tmp_path / "rl/events.jsonl") if e["event"] == "step"]
    assert len(steps) == 2 and all(len(e["weights"]) == 16 for e in steps)


# The recipes' learning (hf_agentic_sft, then hf_agentic: held-out success 0 -> 0.57 ->
# 0.93) is checked against their documented figures by tests/test_recipe_figures.py.
