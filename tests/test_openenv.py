"""OpenEnv environments through openenv's own client (corun/agents/openenv.py,
trainers/hf/openenv_task.py), against the example guessing game
(examples/openenv_guess) served by uvicorn as a run serves it: an episode's reset,
steps and rewards; a failing or hanging step ends only its episode; every session is
closed; an unreachable server or a bad setting fails the run at its start in one
line; the recipe learns (its documented gain); Ctrl-C mid-run leaves no server."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

import corun
from corun.agents.chat import ChatTemplate
from corun.agents.chat_runner import run_chat_episodes
from corun.agents.openenv import OpenEnvEnvironment, TextFields, generic_client
from corun.base.errors import ConfigError
from corun.contract.engine import Generation, Sampling
from corun.contract.policy import ChatMessage
from corun.execution.procs import free_port
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.corun_process import CorunRun
from tests.support.processes import alive, children_of, corun_command, environment
from trainers.agentic.calculator import EnvSettings
from trainers.hf.agentic import chat_episode_metrics
from trainers.hf.openenv_task import OpenEnvSettings, OpenEnvTask, serve
from trainers.hf.tiny import built_in

REPO = Path(__file__).resolve().parents[1]
APP = "examples.openenv_guess.server.app:app"
EXAMPLE = REPO / "examples" / "openenv_guess"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # openenv's client is asyncio code


class Teardowns:
    """What a SetupContext keeps of ``on_teardown``: the stops, run at the end."""

    def __init__(self) -> None:
        self.fns: list[Any] = []

    def on_teardown(self, name: str, fn: Any) -> None:
        self.fns.append(fn)

    def run(self) -> None:
        async def stop_all() -> None:
            for fn in reversed(self.fns):
                await fn()

        anyio.run(stop_all)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The example served as a run serves it (uvicorn in a ChildProcess)."""
    ctx = Teardowns()
    try:
        yield anyio.run(serve, APP, 120.0, ctx)  # type: ignore[arg-type]
    finally:
        ctx.run()


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(built_in()))


def _reply(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def _task(url: str, **settings: Any) -> OpenEnvTask:
    return OpenEnvTask(OpenEnvSettings(url=url, **settings), seed=0, system_prompt="")


# ----------------------------------------------------------------------------- the adapter


@pytest.mark.anyio
async def test_an_episode_is_reset_stepped_and_rewarded_through_the_client(
    url: str, anyio_backend: str
) -> None:
    env = _task(url).make_env(0, 0, EnvSettings())
    with anyio.fail_after(30):
        first = await env.reset(3)  # task 3: the number 4
        low = await env.step(_reply("2"))
        high = await env.step(_reply(" 6"))
        right = await env.step(_reply("4"))
    assert [(m.role, m.text()) for m in first] == [("user", "Guess my number from 1 to 7.")]
    # A wrong guess's hint earns 0.25 x the share of the possible numbers it rules out.
    assert (low.messages[0].text(), low.done) == ("Higher.", False)
    assert low.reward == pytest.approx(0.25 * 2 / 7)  # 1..7 -> 3..7
    assert (high.messages[0].text(), high.done) == ("Lower.", False)
    assert high.reward == pytest.approx(0.25 * 2 / 5)  # 3..7 -> 3..5
    assert (right.messages[0].text(), right.reward, right.done) == ("Correct!", 1.0, True)
    assert env.tools == ()
    assert env.client._ws is None  # type: ignore[attr-defined]  # closed at done
    with pytest.raises(RuntimeError, match="one env per episode"):
        await env.step(_reply("4"))


@pytest.mark.anyio
async def test_the_episode_seed_reaches_the_environments_reset(
    url: str, anyio_backend: str
) -> None:
    """Without a task the game draws its number from the seed: the episode's own."""
    seed = 12345
    secret = random.Random(seed).randint(1, 7)
    env = OpenEnvEnvironment(generic_client(url), seed=seed, reset_kwargs=lambda task: {})
    with anyio.fail_after(30):
        await env.reset(None)
        step = await env.step(_reply(str(secret)))
    assert (step.reward, step.done) == (1.0, True)
    task = _task(url)
    assert task.make_env(2, 5, EnvSettings()).seed == corun.stable_seed("env", 0, 2, 5)
    assert task.make_env(2, 5, EnvSettings()).seed != task.make_env(2, 6, EnvSettings()).seed


def scripted(replies: list[str], template: ChatTemplate) -> Any:
    """An engine's generate that replies ``replies[turn]`` (through the stop token) to
    every prompt."""
    turns: list[int] = []

    async def generate(prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        text = replies[len(turns)]
        turns.append(len(prompts))
        ids = template.reply_ids([ChatMessage(role="user", content="?")], _reply(text))
        return [Generation(ids, [-0.5] * len(ids), [1] * len(ids), "stop") for _ in prompts]

    return generate


class HangingClient:
    """openenv's client whose steps never answer."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def connect(self) -> Any:
        return await self.inner.connect()

    async def reset(self, **kwargs: Any) -> Any:
        return await self.inner.reset(**kwargs)

    async def step(self, action: Any, **kwargs: Any) -> Any:
        await anyio.sleep_forever()

    async def close(self) -> None:
        await self.inner.close()


async def _episodes(
    envs: list[OpenEnvEnvironment], tasks: list[int], replies: list[str],
    template: ChatTemplate, max_turns: int = 3,
) -> list[Any]:  # fmt: skip
    ctx = corun.RolloutContext(0, torch.Generator().manual_seed(0))
    return await run_chat_episodes(
        ctx, envs, tasks, scripted(replies, template), template, Sampling(4, 1.0),
        max_turns=max_turns, max_len=256, step_timeout_s=1.0,
    )  # fmt: skip


@pytest.mark.anyio
async def test_multi_turn_episodes_and_a_failing_or_hanging_step_ends_only_its_own(
    url: str, template: ChatTemplate, anyio_backend: str
) -> None:
    """Four episodes of the game in lockstep: one wins in three turns, one is cut at the
    turn limit, one whose action the server refuses (a field the action has not) fails,
    one whose step hangs times out; the failures are counted, every session closed."""
    task = _task(url)
    envs = [task.make_env(0, row, EnvSettings()) for row in range(4)]
    envs[2] = OpenEnvEnvironment(generic_client(url), fields=TextFields(action_field="guess"))
    envs[3].client = HangingClient(envs[3].client)
    # Tasks 0 and 5: the numbers 1 and 6. Replies "4", "2", "1": 1 is found at turn 3.
    with anyio.fail_after(60):
        episodes = await _episodes(envs, [0, 5, 0, 0], ["4", "2", "1"], template)
    assert [(e.status, e.turns) for e in episodes[:2]] == [("done", 3), ("done", 3)]
    # 1: 4 rules out 4/7, 2 rules out 2/3, 1 is right. 6: 4 rules out 4/7, 2 nothing
    # (ruled out already), 1 is the third wrong guess.
    assert episodes[0].reward == pytest.approx(0.25 * 4 / 7 + 0.25 * 2 / 3 + 1)
    assert episodes[1].reward == pytest.approx(0.25 * 4 / 7)
    assert episodes[2].status == "failed" and "Server error" in episodes[2].reason
    assert episodes[3].status == "timeout"
    metrics = chat_episode_metrics(episodes, task.success)
    assert (metrics["env_failures"], metrics["success"]) == (2.0, 0.25)
    assert all(env.client._ws is None for env in envs[:3])  # type: ignore[attr-defined]
    assert envs[3].client.inner._ws is None  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_an_episode_cut_at_its_turn_limit_has_its_session_closed(
    url: str, template: ChatTemplate, anyio_backend: str
) -> None:
    envs = [_task(url).make_env(0, row, EnvSettings()) for row in range(2)]
    with anyio.fail_after(30):
        episodes = await _episodes(envs, [0, 0], ["4", "2"], template, max_turns=1)
    assert {e.status for e in episodes} == {"turn_limit"}
    assert all(env.client._ws is None for env in envs)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- the start


@pytest.mark.anyio
async def test_an_unreachable_url_or_a_dying_app_fails_the_start_in_one_line(
    anyio_backend: str,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with anyio.fail_after(60):
        with pytest.raises(ConfigError) as unreachable:
            await _task(dead, connect_timeout_s=2.0).start(Teardowns())  # type: ignore[arg-type]
        ctx = Teardowns()
        settings = OpenEnvSettings(app="examples.openenv_guess.no_such_module:app")
        with pytest.raises(ConfigError) as died:
            await OpenEnvTask(settings, 0, "").start(ctx)  # type: ignore[arg-type]
        assert len(ctx.fns) == 1  # its stop, registered before the wait
        await ctx.fns[0]()
    assert dead in str(unreachable.value) and "\n" not in str(unreachable.value)
    message = str(died.value)
    assert "no_such_module" in message and "exited" in message and "\n" not in message


async def _start_on_trio() -> None:
    with anyio.fail_after(10):
        await _task(f"http://127.0.0.1:{free_port()}").start(Teardowns())  # type: ignore[arg-type]


def test_under_trio_the_task_says_it_needs_asyncio_in_one_line() -> None:
    """openenv's client is asyncio code: a trio run (or a trio host) is refused at start
    with the setting to change, before any server starts."""
    with pytest.raises(
        ConfigError, match=r"runs on asyncio only, this run is on trio; set run\.backend"
    ):
        anyio.run(_start_on_trio, backend="trio")


def test_without_openenv_the_task_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # import fails
    with pytest.raises(
        ConfigError, match=r"needs the openenv-core package: pip install -e '\.\[openenv\]'"
    ):
        _task("http://127.0.0.1:1")


def _corun(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*corun_command(), *args], cwd=cwd, env=environment(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def _write_config(tmp_path: Path, environment_table: str, **extra: str) -> Path:
    config = tmp_path / "openenv.toml"
    lines = [
        "[run]", f'dir = "{tmp_path / "run"}"', f"steps = {extra.get('steps', 2)}",
        "[loop]", "baseline_eval = false", "[data]", "batch_size = 2",
        "[log]", 'progress = "plain"',
        "[trainer]", 'kind = "hf_agentic"', 'model = "tiny-llama"', 'task = "openenv"',
        "samples_per_prompt = 2", "max_new_tokens = 4", "eval_size = 4",
        "[trainer.environment]", environment_table,
    ]  # fmt: skip
    config.write_text("\n".join(lines) + "\n")
    return config


@pytest.mark.slow
def test_a_bad_setting_or_an_unreachable_server_exits_2_in_one_line(tmp_path: Path) -> None:
    bad = _corun(["train", str(_write_config(tmp_path, f'app = "{APP}"\nport = 8000'))], REPO)
    assert bad.returncode == 2, bad.stderr
    assert "$.trainer.environment" in bad.stderr and "port" in bad.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    config = _write_config(tmp_path, f'url = "{dead}"\nconnect_timeout_s = 2.0')
    unreachable = _corun(["train", str(config)], REPO)
    assert unreachable.returncode == 2, unreachable.stderr
    lines = [line for line in unreachable.stderr.splitlines() if dead in line]
    assert len(lines) == 1 and "Traceback" not in unreachable.stderr, unreachable.stderr


# ----------------------------------------------------------------------------- Ctrl-C


def _server_pids(pid: int) -> list[int]:
    return [child for child in children_of(pid) if b"uvicorn" in _cmdline(child)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_ctrl_c_mid_run_exits_130_and_leaves_no_environment_server(tmp_path: Path) -> None:
    config = _write_config(tmp_path, f'app = "{APP}"', steps="1000")
    out, err = (tmp_path / "stdout.txt").open("wb"), (tmp_path / "stderr.txt").open("wb")
    # SIGINT at its default in the child (a test runner may start it ignored).
    proc = subprocess.Popen(
        [*corun_command(), "train", str(config)], cwd=REPO, env=environment(),
        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    run = CorunRun(proc, tmp_path, tmp_path / "run", _files=[out, err])
    try:
        run.wait_event("step", 180)  # a step's episodes were played on the served game
        servers = _server_pids(proc.pid)
        assert servers, "no uvicorn child"
        run.send(signal.SIGINT)
        code = run.wait_exit()
        assert code == 130 and "Traceback" not in run.stderr(), run.stderr()
        events = {e["event"]: e for e in run.events()}
        assert events["end"]["reason"] == "interrupted"
        assert events["teardown:openenv-server"]["status"] == "ok"
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in servers), (
            f"environment server {servers} outlived corun"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (out, err):
            f.close()


# ----------------------------------------------------------------------------- the recipe

# What docs/agentic.md quotes, measured on a shared 2-core CPU VM: the greedy success on
# 256 held-out games before and after GRPO.
RECIPE_START, RECIPE_MIN_FINAL = 0.72, 0.95


def _evals(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval/success" in r]


@pytest.mark.slow
def test_the_recipe_learns_the_game(tmp_path: Path) -> None:
    """sft.toml then grpo.toml, as a user runs them from the repository's root (here a
    scratch folder with the example linked in, so the runs stay out of the checkout):
    held-out success rises by several standard errors."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    started = time.monotonic()
    done = _corun(["train", "examples/openenv_guess/grpo.toml", "log.progress=off"], tmp_path, 600)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    evals = _evals(tmp_path / "runs" / "openenv_guess")
    start, final = evals[0]["eval/success"], evals[-1]["eval/success"]
    n = 256
    se = ((start * (1 - start) + final * (1 - final)) / n) ** 0.5
    assert start == pytest.approx(RECIPE_START, abs=0.05)
    assert final >= RECIPE_MIN_FINAL and final - start > 4 * se, (start, final, se, wall)


def test_the_demonstrations_file_is_the_generators(tmp_path: Path) -> None:
    from examples.openenv_guess import demonstrations

    lines = [json.dumps(r) for r in demonstrations.records()]
    assert demonstrations.PATH.read_text().splitlines() == lines


# ----------------------------------------------------------------------------- async


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_async_run_plays_the_served_environment(
    tmp_path: Path, anyio_backend: str
) -> None:
    """``loop.concurrency = 2``: two rollouts' episodes in flight on the served game at
    once, every one played to its end (no failures, no session left behind to run out
    of the server's capacity), under the agentic corrections: the decoupled objective
    and a token-level rollout correction, whose metrics each update reports."""
    trainer = {
        "kind": "hf_agentic", "model": "tiny-llama", "task": "openenv", "samples_per_prompt": 2,
        "max_new_tokens": 4, "eval_size": 8, "environment": {"app": APP},
        "off_policy_correction": "decoupled", "rollout_correction": "token-tis",
    }  # fmt: skip
    config = make_config(
        tmp_path / "run", trainer, run={"steps": 4}, data={"batch_size": 4},
        loop={"concurrency": 2, "workers": 2, "eval_interval": 4},
    )  # fmt: skip
    with anyio.fail_after(240):
        await corun.run(corun.resolve_trainer("hf_agentic")(config), config)
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    rollouts = [r for r in records if "rollout/turns_mean" in r]
    assert len(rollouts) == 4
    assert all(r["rollout/env_failures"] == 0 and r["rollout/turns_mean"] >= 1 for r in rollouts)
    assert [r["eval/env_failures"] for r in records if "eval/success" in r] == [0, 0]
    updates = [r for r in records if "train/loss" in r]
    assert len(updates) == 4
    assert all(r["train/correction/weight_mean"] > 0 and "train/mismatch/k3" in r for r in updates)


async def _play_through_the_endpoint(
    http: httpx.AsyncClient, env_url: str, task: int, episode: str, group: str
) -> float:
    """An agent outside the trainer: it plays one game of the served environment through
    openenv's client, asking the policy through the endpoint (the episode recorded for
    training), and reports the game's reward."""
    env = OpenEnvEnvironment(generic_client(env_url), seed=corun.stable_seed(episode))
    messages = [{"role": m.role, "content": m.text()} for m in await env.reset(task)]
    reward = 0.0
    for _ in range(3):
        body = {"model": "guess", "messages": messages, "max_tokens": 4, "temperature": 1.0,
                "episode_id": episode, "group": group}  # fmt: skip
        response = await http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        text = response.json()["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": text})
        step = await env.step(_reply(text))
        reward += step.reward
        if step.done:
            break
        messages += [{"role": m.role, "content": m.text()} for m in step.messages]
    await env.aclose()
    reported = await http.post(f"/v1/episodes/{episode}/reward", json={"reward": reward})
    reported.raise_for_status()
    return reward


async def _agents(endpoint: str, env_url: str, played: list[float]) -> None:
    """Rounds of two games x two episodes (a GRPO group each) until the run stops."""

    async def game(http: httpx.AsyncClient, round_index: int, k: int) -> None:
        group = f"r{round_index}-g{k // 2}"
        with contextlib.suppress(httpx.HTTPError):  # cut off: the endpoint stopped
            reward = await _play_through_the_endpoint(http, env_url, k // 2, f"{group}-{k}", group)
            played.append(reward)

    async with httpx.AsyncClient(base_url=endpoint, timeout=60) as http:
        for round_index in itertools.count():
            async with anyio.create_task_group() as games:
                for k in range(4):
                    games.start_soon(game, http, round_index, k)


@pytest.mark.slow
@pytest.mark.anyio
async def test_agents_play_it_through_the_endpoint_into_an_async_run(
    url: str, tmp_path: Path, anyio_backend: str
) -> None:
    """``episodes = "submitted"`` with ``loop.concurrency = 2``: agents play the game
    through openenv's client and the policy endpoint; the endpoint's capture hands their
    episodes to the trainer, whose recomputed log-probs match the behaviour ones."""
    trainer = {
        "kind": "hf_agentic", "model": "tiny-llama", "task": "openenv", "samples_per_prompt": 2,
        "max_new_tokens": 4, "eval_size": 4, "episodes": "submitted",
        "environment": {"url": url},
    }  # fmt: skip
    config = make_config(
        tmp_path / "run", trainer, run={"steps": 3, "name": "guess"}, data={"batch_size": 2},
        loop={"concurrency": 2, "workers": 2, "baseline_eval": False, "eval_interval": 3},
        serve={"enabled": True},
    )  # fmt: skip
    played: list[float] = []
    with anyio.fail_after(180):
        async with anyio.create_task_group() as host:
            async with corun.training(config) as session:
                assert session.endpoint_url is not None
                host.start_soon(_agents, session.endpoint_url, url, played)
                await session.finished()
            host.cancel_scope.cancel()
    assert len(played) >= 12
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    first = next(r for r in records if "train/kl" in r)
    assert first["train/kl"] < 1e-6 and first["rollout/turns_mean"] >= 1
    assert len([r for r in records if "rollout/turns_mean" in r]) == 3
