"""SkyRL-Gym text environments (corun/agents/skyrl.py, trainers/hf/skyrl_task.py) with
the real package: the adapter step by step (init, multi-turn observations, rewards,
close), values off the API, environments that raise or hang inside the chat episode
runner, the task's data (exact by seed and index, held-out rows apart, SkyRL's JSONL
format), an unknown env id refused by ``corun train``, and the recipe's learning
(skyrl_sft.toml then skyrl.toml), sync and async."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from skyrl_gym.envs.base_text_env import BaseTextEnv

import corun
from corun.agents.chat_runner import run_chat_episodes
from corun.agents.skyrl import SkyRLEnvironment, registered
from corun.contract.engine import Generation, Sampling
from corun.contract.policy import ChatMessage
from corun.records.events import read_records
from tests.support.cli import assert_usage_error, corun_subprocess
from trainers.hf.skyrl_task import INSTRUCTION, SkyRLSettings, SkyRLTask, read_rows

REPO = Path(__file__).resolve().parents[1]
ROW: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "Ann has 12 apples and gets 7 more. How many now?"}],
    "env_class": "gsm8k_multi_turn",
    "reward_spec": {"method": "rule", "ground_truth": "19"},
    "extra_info": {"max_turns": 3},
}


def say(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


class Closing(BaseTextEnv):
    """A BaseTextEnv that counts its closes and returns what it is given to return."""

    def __init__(self, output: Any = None, error: Exception | None = None) -> None:
        super().__init__()
        self.output, self.error, self.closed = output, error, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self, action: str) -> Any:
        if self.error is not None:
            raise self.error
        if self.output == "hang":
            self.entered.set()
            self.release.wait(10)
        return self.output

    def close(self) -> None:
        self.closed += 1


def fixed(env: BaseTextEnv) -> Any:
    return lambda row: env


def good(reward: Any = 1.0, observations: Any = (), done: Any = True) -> Any:
    return {"observations": list(observations), "reward": reward, "done": done, "metadata": {}}


# ----------------------------------------------------------------------------- the adapter


@pytest.mark.anyio
async def test_a_multi_turn_episode_of_gsm8k_multi_turn(anyio_backend: str) -> None:
    """init gives the row's prompt; a wrong but well-formed answer earns the format
    score and the env's next user message; the right one ends the episode with 1."""
    env = SkyRLEnvironment(registered("gsm8k_multi_turn"))
    with anyio.fail_after(5):
        prompt = await env.reset(ROW)
        assert [(m.role, m.content) for m in prompt] == [("user", ROW["prompt"][0]["content"])]
        wrong = await env.step(say("I think #### 18"))
        assert (wrong.reward, wrong.done) == (pytest.approx(0.2 / 3), False)
        assert [m.role for m in wrong.messages] == ["user"]
        assert "#### ANSWER" in wrong.messages[0].text()
        right = await env.step(say("#### 19"))
    assert (right.messages, right.reward, right.done) == ([], 1.0, True)
    assert env.tools == ()


@pytest.mark.anyio
async def test_single_turn_gsm8k_and_the_env_is_closed_once_done(anyio_backend: str) -> None:
    env = SkyRLEnvironment(registered("gsm8k"))
    with anyio.fail_after(5):
        await env.reset(ROW)
        assert (await env.step(say("#### 20"))).reward == 0
        with pytest.raises(RuntimeError, match="episode is over"):
            await env.step(say("#### 19"))
    closing = Closing(good())
    adapter = SkyRLEnvironment(fixed(closing))
    with anyio.fail_after(5):
        await adapter.reset(ROW)
        await adapter.step(say("x"))
    assert closing.closed == 1


@pytest.mark.anyio
async def test_an_episode_cut_short_is_closed_by_aclose_once(anyio_backend: str) -> None:
    """An episode the runner cut at its turn limit (the env never said done) has its env
    closed by ``aclose`` at the end of the rollout; a second ``aclose``, or one after
    the env closed itself, does nothing."""
    cut = Closing(good(done=False))
    adapter = SkyRLEnvironment(fixed(cut))
    with anyio.fail_after(5):
        await adapter.reset(ROW)
        await adapter.step(say("x"))
        assert cut.closed == 0
        await adapter.aclose()
        await adapter.aclose()
    assert cut.closed == 1
    ended = Closing(good())
    adapter = SkyRLEnvironment(fixed(ended))
    with anyio.fail_after(5):
        await adapter.reset(ROW)
        await adapter.step(say("x"))
        await adapter.aclose()
    assert ended.closed == 1


@pytest.mark.parametrize(
    ("output", "error", "match"),
    [
        (good(reward=float("nan")), ValueError, "reward nan; it must be finite"),
        (good(reward="1"), TypeError, "the reward '1' of type str"),
        (good(done=1), TypeError, "done=1; it must be a bool"),
        ({"reward": 1.0, "done": True}, TypeError, "keys observations, reward, done"),
        (good(observations=["hi"]), TypeError, "messages off the chat format"),
        (good(observations=[{"role": "robot", "content": "x"}]), TypeError, "off the chat"),
        ({**good(), "observations": "hi"}, TypeError, "messages of type str, not a list"),
    ],
)
@pytest.mark.anyio
async def test_values_off_the_api_raise_and_close(
    anyio_backend: str, output: Any, error: type[Exception], match: str
) -> None:
    env = Closing(output)
    adapter = SkyRLEnvironment(fixed(env))
    with anyio.fail_after(5):
        await adapter.reset(ROW)
        with pytest.raises(error, match=match):
            await adapter.step(say("#### 19"))
    assert env.closed == 1


def generate_replies(*texts: str, template: Any) -> Any:
    """An engine's generate replying turn ``t``'s text to every prompt."""
    turns = iter(texts)

    async def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        ids = template.reply_ids([ChatMessage(role="user", content="?")], say(next(turns)))
        return [Generation(ids, [-0.5] * len(ids), [1] * len(ids), "stop") for _ in prompts]

    return generate


@pytest.fixture(scope="module")
def template() -> Any:
    from transformers import AutoTokenizer

    from corun.agents.chat import ChatTemplate
    from trainers.hf.tiny import built_in

    return ChatTemplate(AutoTokenizer.from_pretrained(built_in()))


@pytest.mark.anyio
async def test_broken_envs_fail_only_their_episodes(anyio_backend: str, template: Any) -> None:
    """In the chat runner: a real env answers twice and succeeds; one that raises and
    one that hangs past the step timeout end their own episodes ("failed", "timeout");
    the hung env's thread runs on and is not closed."""
    hanging = Closing("hang")
    raising = Closing(error=ConnectionError("sandbox went away"))
    envs = [SkyRLEnvironment(registered("gsm8k_multi_turn")), SkyRLEnvironment(fixed(raising)),
            SkyRLEnvironment(fixed(hanging))]  # fmt: skip
    ctx = corun.RolloutContext(0, torch.Generator())
    try:
        with anyio.fail_after(10):
            episodes = await run_chat_episodes(
                ctx, envs, [ROW] * 3, generate_replies("#### 18", "#### 19", template=template),
                template, Sampling(16, 1.0), max_turns=3, max_len=256, step_timeout_s=0.3,
            )  # fmt: skip
        assert hanging.entered.is_set()
    finally:
        hanging.release.set()
    assert [e.status for e in episodes] == ["done", "failed", "timeout"]
    assert episodes[0].turns == 2 and episodes[0].reward == pytest.approx(1 + 0.2 / 3)
    assert episodes[1].reason == "ConnectionError: sandbox went away"
    assert (raising.closed, hanging.closed) == (1, 0)


# ----------------------------------------------------------------------------- the task


def test_data_is_exact_by_seed_and_index_and_held_out_apart() -> None:
    task = SkyRLTask(SkyRLSettings(extra_info={"max_turns": 2}), 7, "")
    batch = task.dataset(16).batch(3)
    assert batch == SkyRLTask(SkyRLSettings(extra_info={"max_turns": 2}), 7, "").dataset(16).batch(
        3
    )
    assert batch != task.dataset(16).batch(4)
    row = batch[0]
    assert row["prompt"][0]["content"].endswith(INSTRUCTION) and row["extra_info"]["max_turns"] == 2
    held = {r["prompt"][0]["content"] for r in task.eval_tasks(64)}
    trained = {r["prompt"][0]["content"] for i in range(20) for r in task.dataset(16).batch(i)}
    assert held and not held & trained
    demo = task.demonstration(row)
    assert demo[-1].content == f"#### {row['reward_spec']['ground_truth']}"


def test_a_skyrl_jsonl_file(tmp_path: Path) -> None:
    rows = [{**ROW, "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
             "reward_spec": {"ground_truth": str(i + 1)}} for i in range(40)]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = read_rows(path, "gsm8k_multi_turn")
    assert len(train) + len(held) == 40 and held
    task = SkyRLTask(SkyRLSettings(path=str(path)), 0, "Be brief.")
    assert task.dataset(8).batch(5) == task.dataset(8).batch(5)
    assert task.eval_tasks(100)[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    path.write_text(json.dumps({**ROW, "env_class": "gsm8k"}) + "\n")
    with pytest.raises(corun.DataError, match=r"rows.jsonl:1: env_class 'gsm8k'"):
        read_rows(path, "gsm8k_multi_turn")


def test_an_unknown_env_id_exits_2_naming_the_key(tmp_path: Path) -> None:
    result = corun_subprocess(tmp_path, "train", str(REPO / "configs/skyrl.toml"),
                              "trainer.environment.env=gsm9k")  # fmt: skip
    line = assert_usage_error(result.returncode, result.stderr, "`$.trainer.environment.env`")
    assert "gsm8k_multi_turn" in line and "'gsm9k'" in line


# ----------------------------------------------------------------------------- the recipe


def evals(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if "eval/reward" in r]


def test_the_recipe_learns(tmp_path: Path) -> None:
    """skyrl_sft.toml then skyrl.toml (GRPO on gsm8k_multi_turn): the held-out reward
    rises by more than 2 standard errors (measured: 3.7) (documented in docs/agentic.md)."""
    result = corun_subprocess(tmp_path, "train", str(REPO / "configs/skyrl.toml"))
    assert result.returncode == 0, result.stderr[-2000:]
    first, *_, last = evals(tmp_path / "runs/skyrl")
    se = last["eval/reward_std"] / 256**0.5
    assert last["eval/reward"] - first["eval/reward"] > 2 * se, (first, last)
    # Async (2 batches in flight on 2 workers) from the same warm start: it runs and trains.
    result = corun_subprocess(
        tmp_path, "train", str(REPO / "configs/skyrl.toml"), "run.name=skyrl_async",
        "run.steps=4", "loop.concurrency=2", "loop.workers=2", "loop.eval_interval=4",
        "loop.save_interval=4", "trainer.eval_size=16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_records(tmp_path / "runs/skyrl_async/metrics.jsonl")
    trained = [r for r in rows if "rollout/reward_mean" in r]
    assert len(trained) == 4 and all(r["rollout/env_failures"] == 0 for r in trained)
    assert len(evals(tmp_path / "runs/skyrl_async")) == 2
