"""Real agent frameworks as clients of corun's endpoint, on a Hugging Face policy that
calls tools (tests/support/hf_agents.py's ``tool_model``: the tiny Llama after a short
hf_agentic_sft warm start, which calls the calculator in the Hermes format).

- The ``openai`` SDK against ``corun serve`` (a subprocess): multi-turn calculator
  episodes — tools offered, the policy calls the calculator, the client runs it and
  re-sends the history with the result, the policy answers — plain and streamed
  (tool-call deltas accumulated), through the episode's own base URL, then rewarded.
- In process, where the recorded episode can be read: its trained ids are exactly the
  ``token_ids`` of each reply, the tool result is in the transcript once and untrained
  (asyncio and trio: the ``openai`` SDK runs under trio too).
- The OpenAI Agents SDK (``agents``): an ``Agent`` with a ``@function_tool`` calculator
  on ``OpenAIChatCompletionsModel`` over the episode's base URL, ``Runner.run`` and
  ``Runner.run_streamed``, recorded and rewarded (asyncio only: the SDK is).
- 32 agents through the endpoint while ``hf_agentic`` trains on what they submit,
  across several weight syncs (asyncio and trio): no 5xx, every reply's version
  recorded, per-token versions monotone within an episode, several versions served.
- An engine that skips a weight reload fails ``corun train`` at that sync with one
  line naming the version, exit status 1.
"""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest

import corun
from corun.agents.chat import ChatTemplate
from corun.contract.episodes import Episode
from corun.contract.policy import ChatMessage, ToolSpec
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.corun_process import CorunRun
from tests.support.hf_agents import (
    MODEL,
    TOOL_SPECS,
    Played,
    RecordingHFAgentic,
    Teams,
    play,
    question,
    reward,
    run_call,
    serving,
    taken,
)
from trainers.agentic.calculator import Problem
from trainers.hf.policy import load_policy

pytestmark = pytest.mark.anyio
PROBLEM = Problem(123, 456)


def _calls(played: Played) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for t in played.turns for c in t.message.get("tool_calls") or ()]  # fmt: skip


def _assert_tool_episode(played: Played) -> None:
    """Two replies: a well-formed calculator call, then a text answer."""
    first, last = played.turns[0], played.turns[-1]
    assert len(played.turns) == 2, played.messages
    assert first.finish == "tool_calls" and first.message["content"] is None
    (name, arguments), = _calls(played)  # fmt: skip
    assert name == "calculator" and set(arguments) == {"expression"}
    assert played.messages[2]["role"] == "tool"
    assert played.messages[2]["content"] == run_call(json.dumps(arguments))
    assert last.finish == "stop" and not last.message.get("tool_calls")
    assert last.message["content"].strip().isdigit()


async def _reward(url: str, episode: str, value: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        reported = await http.post(f"/v1/episodes/{episode}/reward", json={"reward": value})
    assert reported.status_code == 200, reported.text
    return dict(reported.json())


def _follow(template: ChatTemplate, played: Played) -> list[int]:
    """The template's ids between the first reply and the second: what the endpoint
    appends, untrained, for the tool message."""
    sent = msgspec.convert(played.messages, list[ChatMessage])
    tools = msgspec.convert(TOOL_SPECS, list[ToolSpec])
    return template.continuation(sent[:2], sent[2:3], tools, stopped=True)


# ----------------------------------------------------------------------------- openai SDK


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_openai_sdk_tool_episodes_against_corun_serve(
    start_corun: Any, tool_model: Path, anyio_backend: str
) -> None:
    """``corun serve`` on the warm start; an episode played plain, then the same one
    streamed (greedy: the same replies), each through its own base URL and rewarded:
    the endpoint counts the replies' tokens and the tool result's continuation."""
    trainer = {"kind": "hf_agentic", "model": "tiny-llama", "init_from": str(tool_model)}
    run: CorunRun = start_corun(trainer, command="serve", run={"name": MODEL})
    run.wait_until("the URL on stdout", lambda: "corun: serving" in run.stdout())
    # (Not the first line here: building the tiny model in this fresh directory prints
    # blank lines first — tokenizers' BPE trainer's progress.)
    url = run.stdout().split("corun: serving ")[1].split()[0]
    played: dict[bool, Played] = {}
    tokens: dict[bool, int] = {}
    with anyio.fail_after(60):
        for stream in (False, True):
            base = f"{url}/episodes/ep-{stream}/v1"
            async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
                played[stream] = await play(client, PROBLEM, stream=stream)
            _assert_tool_episode(played[stream])
            reported = await _reward(url, f"ep-{stream}", played[stream].reward)
            assert reported["turns"] == 2
            tokens[stream] = reported["tokens"]
    plain, streamed = played[False], played[True]
    _, tokenizer = load_policy("tiny-llama", "test")
    ids = [t.token_ids or [] for t in plain.turns]
    follow = _follow(ChatTemplate(tokenizer), plain)
    assert tokens[False] == tokens[True] == len(ids[0]) + len(follow) + len(ids[1])
    assert _calls(streamed) == _calls(plain)  # greedy: the same replies
    assert streamed.messages[-1] == plain.messages[-1]
    run.send(signal.SIGINT)
    assert run.wait_exit() == 130 and "Traceback" not in run.stderr()


async def test_openai_sdk_episode_is_recorded_token_for_token(
    tool_model: Path, anyio_backend: str
) -> None:
    """The recorded episode is the rendered question, the first reply's ``token_ids``
    (trained), the tool result once (untrained), the second reply's (trained); a
    streamed episode records the replies it streamed."""
    with anyio.fail_after(60):
        async with serving(tool_model) as served:
            played = {}
            for stream in (False, True):
                base = f"{served.url}/episodes/ep-{stream}/v1"
                async with openai.AsyncOpenAI(base_url=base, api_key="unused") as client:
                    played[stream] = await play(client, PROBLEM, stream=stream)
                _assert_tool_episode(played[stream])
                await _reward(served.url, f"ep-{stream}", played[stream].reward)
            plain, streamed = await taken(served.inbox, 2)
    template, tools = served.template, msgspec.convert(TOOL_SPECS, list[ToolSpec])
    ids = [t.token_ids or [] for t in played[False].turns]
    follow = _follow(template, played[False])
    question_ = [ChatMessage(role="user", content=question(PROBLEM))]
    assert plain.prompt_ids == template.render(question_, tools)
    assert plain.ids == [*ids[0], *follow, *ids[1]]
    assert plain.trained == [True] * len(ids[0]) + [False] * len(follow) + [True] * len(ids[1])
    assert plain.versions == [0] * len(ids[0]) + [-1] * len(follow) + [0] * len(ids[1])
    result = played[False].messages[2]["content"]
    assert template.decode(plain.prompt_ids + plain.ids).count(f"tool: {result}\n") == 1
    assert plain.reward == played[False].reward and plain.turns == 2
    # Streamed: the chunks carry no ids; what was recorded parses to what was streamed.
    for turn, replied in zip(_trained_runs(streamed), played[True].turns, strict=True):
        parsed = template.parse(turn, ["calculator"])
        assert parsed.content == replied.message["content"]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in replied.message.get("tool_calls") or ()]  # fmt: skip
    assert streamed.ids == plain.ids  # greedy: the same episode


def _trained_runs(episode: Episode) -> list[list[int]]:
    """An episode's trained ids, reply by reply."""
    runs = itertools.groupby(zip(episode.ids, episode.trained, strict=True), lambda p: p[1])
    return [[i for i, _ in run] for trained, run in runs if trained]


# ----------------------------------------------------------------------------- Agents SDK


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the Agents SDK runs on asyncio
async def test_agents_sdk_runs_are_recorded_and_rewarded(
    tool_model: Path, anyio_backend: str
) -> None:
    """An ``Agent`` with a ``@function_tool`` calculator, its model on the episode's
    base URL: ``Runner.run`` and ``Runner.run_streamed`` call the tool once and answer;
    the endpoint records each run as a two-reply episode (what the SDK adds to a
    request — ``tool_choice``, ``parallel_tool_calls``, ``stream_options``, ``store``,
    ``metadata`` — is accepted), and the reward ends it."""
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves the machine
    called: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Adds two numbers."""
        called.append(expression)
        return run_call(json.dumps({"expression": expression}))

    settings = agents.ModelSettings(
        temperature=0.0, max_tokens=96, tool_choice="auto", parallel_tool_calls=False,
        store=False, metadata={"test": "agents"},
    )  # fmt: skip
    with anyio.fail_after(60):
        async with serving(tool_model) as served:
            for stream in (False, True):
                base = f"{served.url}/episodes/sdk-{stream}/v1"
                client = openai.AsyncOpenAI(base_url=base, api_key="unused")
                model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
                agent = agents.Agent(name="adder", tools=[calculator], model=model,
                                     model_settings=settings)  # fmt: skip
                if stream:
                    result: Any = agents.Runner.run_streamed(agent, question(PROBLEM))
                    events = [event.type async for event in result.stream_events()]
                    assert "raw_response_event" in events
                else:
                    result = await agents.Runner.run(agent, question(PROBLEM), max_turns=4)
                kinds = [item.type for item in result.new_items]
                assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
                score = reward(PROBLEM, result.final_output)
                reported = await _reward(served.url, f"sdk-{stream}", score)
                assert reported["turns"] == 2
                await client.close()
            recorded = await taken(served.inbox, 2)
    assert len(called) == 2 and called[0] == called[1]
    for episode in recorded:
        text = served.template.decode(episode.prompt_ids + episode.ids)
        result = run_call(json.dumps({"expression": called[0]}))
        assert text.count("<tool_call>") == 1 and text.count(f"tool: {result}\n") == 1
        assert episode.turns == 2 and sum(not t for t in episode.trained) > 0
    assert recorded[0].ids == recorded[1].ids  # greedy, streamed or not


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
async def test_32_agents_across_weight_syncs(
    tmp_path: Path, tool_model: Path, anyio_backend: str
) -> None:
    """``hf_agentic`` trains on the episodes 32 agents (the ``openai`` SDK, each episode
    on its own base URL) play through its endpoint — 8 teams of 4, a team's 4 on one
    problem (a GRPO group) — 4 steps of 4 groups: no request fails (but for the 400 a
    conversation longer than the model's 256 positions gets, which ends its episode),
    every reply carries its version, the episodes trained on hold per-token versions that never
    decrease, and several versions were served.

    (Teams, and an inbox that holds 32 episodes: the inbox's back-pressure counts
    episodes of incomplete groups too, so agents spread over more groups than it holds
    could fill it with no complete group and wait forever.)"""
    steps, group = 4, 4
    config = make_config(tmp_path, {
        "kind": "tests.support.hf_agents:RecordingHFAgentic", "model": "tiny-llama",
        "init_from": str(tool_model), "episodes": "submitted", "samples_per_prompt": group,
        "max_new_tokens": 96, "temperature": 0.7, "off_policy_correction": "decoupled",
    }, run={"steps": steps, "name": MODEL, "backend": anyio_backend},
        data={"batch_size": 4}, loop={"baseline_eval": False, "max_staleness": 2},
        serve={"enabled": True})  # fmt: skip
    trainer = RecordingHFAgentic(config)
    with anyio.fail_after(120):
        async with corun.training(config, trainer) as session:
            assert session.endpoint_url is not None
            client = openai.AsyncOpenAI(base_url=session.endpoint_url, api_key="unused",
                                        max_retries=0, timeout=60)  # fmt: skip
            async with client, httpx.AsyncClient(timeout=60) as http:
                teams = Teams(client, http, session.endpoint_url, group)
                async with anyio.create_task_group() as agents:
                    for k in range(32 // group):
                        agents.start_soon(teams.team, k)
                    await session.wait_for_version(steps)
                    agents.cancel_scope.cancel()  # (mid-request: the client goes away)
            outcome = await session.finished()
    assert outcome is not None and outcome.reason == "done" and outcome.step == steps
    assert not teams.failures, teams.failures[:5]
    assert len(set(teams.versions)) > 1, sorted(set(teams.versions))
    events = read_records(tmp_path / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "sync"] == list(range(1, steps + 1))
    dropped = sum(e["event"] == "drop" for e in events)  # too stale: taken again
    assert len(trainer.taken) == (steps + dropped) * 4 * group
    for episode in trainer.taken:
        sampled = [v for v, t in zip(episode.versions, episode.trained, strict=True) if t]
        assert sampled == sorted(sampled) and sampled[0] >= 0


# ----------------------------------------------------------------------------- fingerprints


@pytest.mark.slow
def test_a_skipped_reload_fails_the_run_naming_the_version(
    start_corun: Any, tool_model: Path
) -> None:
    """The engine skips the reload of version 2 (version 1 loads): the sync's
    fingerprint check fails the run there, one line, exit status 1. (From the warm
    start, so that rewards differ within a group and every update changes the weights:
    a skipped reload of unchanged weights serves the trained weights, rightly unseen.)"""
    trainer = {
        "kind": "tests.support.hf_agents:SkipReloadHFAgentic", "model": "tiny-llama",
        "init_from": str(tool_model), "skip_reload_at": 2, "samples_per_prompt": 4,
        "max_new_tokens": 96, "temperature": 1.0,
        # a copy of its own to skip a reload into (a shared one has the weights anyway)
        "engine_options": {"share_weights": False},
    }  # fmt: skip
    run: CorunRun = start_corun(trainer, run={"steps": 4}, data={"batch_size": 2},
                                loop={"baseline_eval": False})  # fmt: skip
    assert run.wait_exit(timeout=120) == 1
    errors = [line for line in run.stderr().splitlines() if line.startswith("corun: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr(), run.stderr()
    assert errors[0].startswith("corun: error: weight sync to version 2: the engine serves ")
    assert errors[0].endswith("(it did not reload them)")
    syncs = [e for e in run.events() if e["event"] == "sync"]
    assert [e["version"] for e in syncs] == [1], syncs
