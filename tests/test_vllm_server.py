"""The vLLM OpenAI server in a child process as a rollout engine
(corun/engines/vllm_server.py, corun/engines/vllm_worker.py).

- Behaviour log-probs over HTTP match the HF policy's recomputed ones at version 0 and
  after three weight syncs (top-p, full distribution, greedy); every sync is real. Top
  log-probs are the policy's most likely tokens; the weights fingerprint the server's
  worker reports follows the syncs, and a skipped sync fails with its version.
- A failed reload kills the engine: EngineError, ``health()`` false, later calls fail
  at once, and shutdown leaves no process of the server's group.
- Through a real ``corun train``: a bad server option is exit 2 naming it; Ctrl-C
  during the server's start-up is exit 130 with the teardown order and the server's
  group gone; a server SIGKILLed mid-run fails the run with exit 1 and one line; a
  corun SIGKILLed during the server's start-up takes the server with it.

A server takes ~30-45 s to start on two cores, so the in-process tests share one
(``servers``) and the subprocess tests start as few as they can.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("vllm")

from corun.contract.engine import Delta, Sampling
from corun.engines.options import VLLMConfig
from corun.engines.vllm_server import WORKER, VLLMServerEngine
from corun.execution import procs
from tests.support.cli import assert_usage_error
from tests.support.corun_process import CorunRun, assert_interrupted
from tests.support.processes import children_of, group_alive
from tests.support.vllm_helpers import (
    RUN_TABLES,
    SAMPLINGS,
    Engines,
    assert_failed_reload_kills,
    assert_fingerprints_follow_syncs,
    assert_group_gone,
    assert_logprobs_follow_syncs,
    assert_top_logprobs,
    hf_trainer,
    prompts,
    sampling_of,
)
from trainers.hf.policy import ChatFormat, HFPolicy

# Every test here runs a vLLM server (30-45 s to start) or a `corun train` subprocess.
pytestmark = pytest.mark.slow

START_S = 240.0  # a server's start-up on a busy two-core machine, with margin


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[Engines[VLLMServerEngine]]:
    config = VLLMConfig(model=str(model_dir), start_timeout_s=START_S)
    held = Engines(lambda: VLLMServerEngine.start(config), START_S + 30)
    yield held
    anyio.run(held.release)


# ------------------------------------------------------------------ the engine itself


@pytest.mark.parametrize("case", list(SAMPLINGS))
@pytest.mark.anyio
async def test_behaviour_logprobs_match_policy_across_syncs(
    servers: Engines[VLLMServerEngine], policy: HFPolicy, chat: ChatFormat, case: str
) -> None:
    engine = await servers.get()
    with anyio.fail_after(120):
        await assert_logprobs_follow_syncs(engine, policy, chat, sampling_of(case, chat))


@pytest.mark.parametrize("case", list(SAMPLINGS))
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # HTTP: the backends are above
@pytest.mark.anyio
async def test_top_logprobs(
    servers: Engines[VLLMServerEngine], policy: HFPolicy, chat: ChatFormat, case: str
) -> None:
    engine = await servers.get()
    with anyio.fail_after(60):
        await assert_top_logprobs(engine, policy, chat, sampling_of(case, chat))


@pytest.mark.anyio
async def test_fingerprint_follows_syncs(
    servers: Engines[VLLMServerEngine], policy: HFPolicy
) -> None:
    engine = await servers.get()
    with anyio.fail_after(60):
        await assert_fingerprints_follow_syncs(engine, policy)


@pytest.mark.anyio
async def test_a_streamed_generation_is_the_whole_one_in_pieces(
    servers: Engines[VLLMServerEngine], chat: ChatFormat
) -> None:
    """``generate_stream``: each request's chunks reach the sink as vLLM sends them;
    joined, they are ``generate``'s tokens for the same seed (log-probs and top
    log-probs too). A row the sink declines stops early; the others run to the end."""
    engine = await servers.get()
    sampling = Sampling(max_tokens=40, temperature=1.0, top_p=1.0, top_logprobs=2)
    asks = prompts(chat, 4)
    deltas: dict[int, list[Delta]] = {row: [] for row in range(len(asks))}

    def sink(row: int, delta: Delta) -> bool:
        deltas[row].append(delta)
        return row != 0 or sum(len(d.ids) for d in deltas[0]) < 5  # row 0: 5 tokens at most

    with anyio.fail_after(120):
        whole = await engine.generate(asks, sampling, 7)
        streamed = await engine.generate_stream(asks, sampling, 7, sink)
    for row in range(1, len(asks)):
        joined = [i for d in deltas[row] for i in d.ids]
        assert joined == streamed[row].ids == whole[row].ids and len(joined) == 40
        assert len(deltas[row]) > 10  # in pieces, not one reply at the end
        lps = [x for d in deltas[row] for x in d.logprobs]
        assert lps == pytest.approx(whole[row].logprobs, abs=1e-5)
        tops = [[i for i, _ in step] for d in deltas[row] for step in d.top or []]
        assert tops == [[i for i, _ in step] for step in whole[row].top or []]
    declined = [i for d in deltas[0] for i in d.ids]
    assert streamed[0].ids == declined == whole[0].ids[: len(declined)]
    assert 5 <= len(declined) < 40 and streamed[0].finish == "length"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a second server start: ~30 s
@pytest.mark.anyio
async def test_failed_reload_kills_the_engine(
    servers: Engines[VLLMServerEngine], policy: HFPolicy
) -> None:
    engine = await servers.get()
    failed = await assert_failed_reload_kills(engine, policy)
    await servers.release()
    assert not procs.group_running(engine.pid)  # shutdown returned: nothing runs
    assert_group_gone(engine.pid)  # and its orphans' zombies are reaped (by init)
    remove_kept_log(str(failed))


# ----------------------------------------------------------- through `corun train`


@dataclass
class Server:
    pgid: int  # its pid, which is also its process group's id
    workdir: Path  # corun-vllm-*: its log (and weights)


@pytest.fixture
def servers_found() -> Iterator[list[Server]]:
    """The servers a test found: their groups SIGKILLed and directories removed at the
    end, so a failing test leaves nothing behind (start_corun's clean-up kills a pid)."""
    found: list[Server] = []
    yield found
    for server in found:
        try:
            os.killpg(server.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(server.workdir, ignore_errors=True)


def find_server(run: CorunRun, found: list[Server]) -> Server:
    """The run's vLLM server, once its process runs; noted in ``found``."""

    def started() -> bool:
        for pid in children_of(run.proc.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                log = Path(os.readlink(f"/proc/{pid}/fd/1"))  # <workdir>/server.log
            except OSError:
                continue
            if WORKER.encode() in command and os.getpgid(pid) == pid:
                found.append(Server(pid, log.parent))
                return True
        return False

    run.wait_until("the vLLM server process", started, timeout=120)
    assert found[-1].workdir.name.startswith("corun-vllm-"), found[-1]
    return found[-1]


def remove_kept_log(message: str) -> None:
    """A dead engine keeps its directory for the post-mortem and names its log."""
    log = re.search(r"log: (\S+/server\.log)", message)
    assert log is not None, message
    assert Path(log[1]).exists()
    shutil.rmtree(Path(log[1]).parent)


def server_trainer(model_dir: Path, **settings: Any) -> dict[str, Any]:
    options = {"start_timeout_s": START_S, **settings.pop("engine_options", {})}
    return hf_trainer(model_dir, engine="vllm-server", engine_options=options, **settings)


@pytest.mark.parametrize(
    ("options", "place"),
    [
        pytest.param({"bogus_flag": 1}, "options.bogus_flag", id="unknown"),
        pytest.param({"port": 1}, "options.port", id="set-by-corun"),
    ],
)
def test_bad_server_option_is_exit_2(
    start_corun: Callable[..., CorunRun], model_dir: Path, options: dict[str, Any], place: str
) -> None:
    trainer = server_trainer(model_dir, engine_options={"options": options})
    run = start_corun(trainer, **RUN_TABLES)
    code = run.wait_exit(timeout=START_S)
    assert_usage_error(code, run.stderr(), f"`$.trainer.engine_options.{place}`")


def test_ctrl_c_during_server_start_up(
    start_corun: Callable[..., CorunRun], servers_found: list[Server], model_dir: Path
) -> None:
    """SIGINT while the server starts (its process runs, set-up has not finished):
    exit 130, the teardown steps registered so far in order, the group gone."""
    run = start_corun(server_trainer(model_dir), **RUN_TABLES)
    pgid = find_server(run, servers_found).pgid
    assert "setup" not in run.names()
    run.send(signal.SIGINT)
    code = run.wait_exit(timeout=60)
    events = assert_interrupted(run, code, signal.SIGINT, complete=False)
    names = [e["event"] for e in events]
    assert "setup" not in names
    # The engine's own start ended the server; its teardown step was never registered.
    assert [n for n in names if n.startswith("teardown:")] == [
        "teardown:stop", "teardown:logging", "teardown:on_train_end",
    ]  # fmt: skip
    assert_group_gone(pgid)


def test_server_killed_mid_run_fails_the_run(
    start_corun: Callable[..., CorunRun], servers_found: list[Server], model_dir: Path
) -> None:
    """The server SIGKILLed after a step: the next engine call sees it gone, the run
    fails with exit 1 and one line naming the server, and nothing is left."""
    run = start_corun(server_trainer(model_dir), run={"steps": 10_000}, **RUN_TABLES)
    pgid = find_server(run, servers_found).pgid
    run.wait_event("step", timeout=START_S)  # the server's start-up comes first
    os.kill(pgid, signal.SIGKILL)
    code = run.wait_exit(timeout=60)
    stderr = run.stderr()
    assert code == 1, f"exit status {code}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if "vLLM server" in line]
    assert len(lines) == 1, stderr
    assert f"pid {pgid}" in lines[0] and "SIGKILL" in lines[0], lines[0]
    events = run.events()
    assert events[-1]["event"] == "end" and events[-1]["reason"] == "error", events[-1]
    engine = next(e for e in events if e["event"] == "teardown:engine")
    assert engine["status"] == "ok", engine
    assert_group_gone(pgid)
    remove_kept_log(lines[0])


def test_server_dies_with_its_run(
    start_corun: Callable[..., CorunRun], servers_found: list[Server], model_dir: Path
) -> None:
    """``corun train`` SIGKILLed (no teardown at all) while the server is still
    importing vLLM: the server notices its parent is gone and kills its group."""
    run = start_corun(server_trainer(model_dir), **RUN_TABLES)
    server = find_server(run, servers_found)
    run.proc.kill()
    run.proc.wait()
    assert_group_gone(server.pgid, timeout_s=120.0)  # after its imports (seconds) + 0.5 s
    assert not server.workdir.exists()  # nobody is left to read its log


def test_group_alive_sees_a_live_group() -> None:
    """The check the tests above rely on answers both ways."""
    assert group_alive(os.getpgrp())
    assert not group_alive(2**22 + 12345)
