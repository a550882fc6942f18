"""A fleet of rollout engines in other processes (``corun engine serve``; the trainer's
``engine = "remote"``: corun/engines/fleet.py), here two or three servers on loopback,
each a separate process as it would be on another machine.

- A GRPO run on the fleet trains exactly as the same run on its own in-process engine
  (the members hold the synced weights, and a generation depends only on its seed), and
  its held-out reward rises; every sync is verified by every member's fingerprint.
- A member killed with SIGKILL mid-run is dropped, its generation retried on another:
  the run completes (one ``fleet: dropped`` line). A member restarted mid-run rejoins
  and is synced to the current version before it serves.
- Ctrl-C of the trainer: exit 130, the fleet keeps serving. Ctrl-C of a member: it
  exits 130 and the trainer goes on with the others.
- No member left: the run fails in one line after ``rollout.fleet_timeout_s``; a
  member that does not answer at start fails the run at once, naming it.
- A multi-turn episode's next turn goes back to the member that served its last one.
- A server answers bad requests with a 4xx JSON error and serves on; a config whose
  trainer has no rollout engine is refused by ``corun engine serve`` (exit 2).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corun.records.events import read_records
from tests.support.processes import REPO, wait_until

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
BASE = ['trainer.init_from=""', "log.progress=off"]  # the servers start from the model
# The recipe otherwise (16 prompts x 8 samples, lr 3e-4), at a constant rate: over 100
# steps its cosine decay would spend half the steps at a fraction of it.
RUN = ["trainer.eval_size=512", "loop.lr_schedule=constant"]


class Server:
    """``corun engine serve hf_grpo`` in a process of its own (SIGINT at its default)."""

    def __init__(self, root: Path, port: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.log = root / f"server-{time.monotonic_ns()}.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corun", "engine", "serve", "hf_grpo", *BASE,
                 f"run.dir={root / 'servers'}", f"serve.port={port}", *extra],
                cwd=root, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip
        found: list[str] = []

        def serving() -> bool:
            found[:] = re.findall(r"serving (http://\S+)", self.log.read_text())
            return bool(found) or self.proc.poll() is not None

        wait_until(serving, 120.0)
        assert found, self.log.read_text()
        self.url = found[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def version(self) -> int:
        return int(httpx.get(self.url + "/health", timeout=5).json()["version"])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/hf_sft.toml as shipped (200 steps, ~20 s): the warm start hf_grpo learns from."""
    root = tmp_path_factory.mktemp("sft")
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", "hf_sft", f"run.dir={root / 'run'}",
         "log.progress=off"],
        cwd=root, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "run" / "checkpoints" / "step-200"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[Server]]:
    servers = [Server(tmp_path) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop(signal.SIGKILL)


def train(
    root: Path, name: str, warm: Path, urls: list[str] | None, *extra: str,
    wait: bool = True,
) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:  # fmt: skip
    engine = ["trainer.engine=remote", f"trainer.engine_options.urls={urls!r}".replace("'", '"')]
    command = [
        sys.executable, "-m", "corun", "train", "hf_grpo", f"trainer.init_from={str(warm)!r}",
        "log.progress=off", f"run.dir={root / name}", *RUN, *(engine if urls else []), *extra,
    ]  # fmt: skip
    if wait:
        return subprocess.run(command, cwd=root, env=ENV, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
    return subprocess.Popen(
        command, cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = read_records(path) if path.exists() else []
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows
            if "train/loss" in r]  # fmt: skip


def trained(run_dir: Path) -> list[dict[str, Any]]:
    """The steps' records without the fleet's own counts."""
    return [{k: v for k, v in r.items() if not k.startswith("fleet/")} for r in steps(run_dir)]


def evals(run_dir: Path) -> list[float]:
    return [r["eval/reward"] for r in read_records(run_dir / "metrics.jsonl") if "eval/reward" in r]


FLEET_STEPS = 40


def test_the_fleet_trains_as_the_local_engine(
    tmp_path: Path, warm: Path, fleet: list[Server]
) -> None:
    """40 steps through two members equal, record for record, the local engine's run,
    held-out evaluations included, each step's sync verified on every member. How much
    that run learns is the local engine's figure (test_recipe_figures' `hf_grpo`: 100
    steps move its held-out reward by about one standard error, too little to assert)."""
    urls = [s.url for s in fleet]
    cadence = [f"run.steps={FLEET_STEPS}", f"loop.eval_interval={FLEET_STEPS // 2}"]
    remote = train(tmp_path, "remote", warm, urls, *cadence)
    assert remote.returncode == 0, remote.stderr[-3000:]
    # The local engine with a copy of its own, as each member holds: the same rounding.
    local = train(
        tmp_path, "local", warm, None, *cadence, "trainer.engine_options.share_weights=false"
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert len(trained(tmp_path / "remote")) == FLEET_STEPS
    assert trained(tmp_path / "remote") == trained(tmp_path / "local")
    assert len(evals(tmp_path / "remote")) == 3  # steps 0, 20 and 40
    assert evals(tmp_path / "remote") == evals(tmp_path / "local")
    syncs = [e for e in read_records(tmp_path / "remote" / "events.jsonl") if e["event"] == "sync"]
    assert len(syncs) == FLEET_STEPS and all(e["weights"] for e in syncs)  # each verified
    assert all(server.version() == FLEET_STEPS for server in fleet)


def test_a_member_killed_then_restarted(tmp_path: Path, warm: Path, fleet: list[Server]) -> None:
    # Steps enough to outlast the member's restart on a quiet machine too: there 40 steps
    # took ~10 s, and the run ended before the restarted member served.
    steps_in_all = 100
    run = train(tmp_path, "run", warm, [s.url for s in fleet], f"run.steps={steps_in_all}",
                f"loop.eval_interval={steps_in_all}", wait=False)  # fmt: skip
    assert isinstance(run, subprocess.Popen)
    wait_until(lambda: len(steps(tmp_path / "run")) >= 3, 300.0)
    fleet[1].stop(signal.SIGKILL)
    wait_until(lambda: len(steps(tmp_path / "run")) >= 10, 300.0)
    fleet[1] = Server(tmp_path, fleet[1].port)  # back on its address
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert f"corun: fleet: dropped {fleet[1].url}" in stderr
    assert f"corun: fleet: {fleet[1].url} is back" in stderr
    assert [r["step"] for r in steps(tmp_path / "run")] == list(range(1, steps_in_all + 1))
    assert fleet[1].version() == steps_in_all  # synced with the others since it came back
    last = steps(tmp_path / "run")[-1]
    assert (last["fleet/dropped"], last["fleet/rejoined"]) == (1.0, 1.0)
    assert last["fleet/members_serving"] == 2.0 and last["fleet/retried"] <= 1.0


def test_ctrl_c_of_the_trainer_and_of_a_member(
    tmp_path: Path, warm: Path, fleet: list[Server]
) -> None:
    run = train(tmp_path, "run", warm, [s.url for s in fleet], "run.steps=1000", wait=False)
    assert isinstance(run, subprocess.Popen)
    wait_until(lambda: len(steps(tmp_path / "run")) >= 2, 300.0)
    assert fleet[0].stop(signal.SIGINT) == 130  # a member: the trainer goes on
    trained = len(steps(tmp_path / "run"))
    wait_until(lambda: len(steps(tmp_path / "run")) >= trained + 2, 300.0)
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert fleet[1].version() > trained  # it synced since, and serves on (the user's)


def test_no_member_left_fails_the_run(tmp_path: Path, warm: Path, fleet: list[Server]) -> None:
    run = train(tmp_path, "run", warm, [s.url for s in fleet], "run.steps=1000",
                "rollout.fleet_timeout_s=3", wait=False)  # fmt: skip
    assert isinstance(run, subprocess.Popen)
    wait_until(lambda: len(steps(tmp_path / "run")) >= 2, 300.0)
    for server in fleet:
        server.stop(signal.SIGKILL)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("corun: error")]
    assert len(errors) == 1 and "(rollout.fleet_timeout_s)" in errors[0], stderr[-3000:]


def test_a_member_that_does_not_answer_fails_the_start(tmp_path: Path, warm: Path) -> None:
    done = train(tmp_path, "run", warm, ["http://127.0.0.1:9"], "run.steps=2")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("corun: error")]
    assert len(errors) == 1 and "fleet member http://127.0.0.1:9 does not answer" in errors[0]


def test_bad_requests_get_4xx_and_the_server_serves_on(fleet: list[Server]) -> None:
    url = fleet[0].url
    cases = [
        ("/generate", b"{not json", 400),
        ("/generate", b'{"prompts": [[1]], "seed": 0}', 400),  # no sampling
        ("/weights/1/bucket", b"not safetensors", 400),
        ("/weights/7/commit", b'{"tensors": 3}', 409),  # nothing staged for version 7
    ]
    for path, body, status in cases:
        response = httpx.post(url + path, content=body, timeout=10)
        assert response.status_code == status, (path, response.text)
        assert response.json()["error"], response.text
    assert fleet[0].version() == 0  # nothing loaded, still serving


def test_a_trainer_without_an_engine_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "corun", "engine", "serve", "sft", f"run.dir={tmp_path / 'r'}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("corun: error: `corun engine serve`: trainer 'sft' has no rollout engine")
    ), done.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_an_episodes_next_turn_goes_back_to_its_member(fleet: list[Server]) -> None:
    """Two episodes start at once, one on each member; the second one's next turns
    (each transcript extends the last) go back to its member, though the other is
    then the less busy."""
    import anyio

    from corun.contract.engine import Sampling
    from corun.engines.fleet import FleetEngine

    with anyio.fail_after(120):
        engine = await FleetEngine.connect(
            [s.url for s in fleet], request_timeout_s=60, fleet_timeout_s=10, bucket_mb=64
        )
        sampling = Sampling(max_tokens=4)
        first, second = [[5, 6, 7, 8]], [[9, 10, 11, 12]]
        async with anyio.create_task_group() as group:
            group.start_soon(engine.generate, first, sampling, 0)
            group.start_soon(engine.generate, second, sampling, 1)
        assert [m.served for m in engine.members] == [1, 1]
        served_second = engine._follows(tuple(second[0]))
        assert served_second is not None
        served_second.busy += 5  # as if loaded: the least busy is now the other member
        turn = await engine.generate(second, sampling, 1)
        await engine.generate([second[0] + turn[0].ids + [3]], sampling, 2)
        served_second.busy -= 5
        assert served_second.served == 3
        assert sum(m.served for m in engine.members) == 4


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the fleet's calls: trio above
async def test_a_fleet_scores_for_a_distillation_teacher(
    tmp_path: Path, fleet: list[Server], anyio_backend: str
) -> None:
    """``/score`` on the members (local engines): the teacher's log-probs of given
    completions equal the model's own; whole rows are refused in one line; and
    ``hf_distill`` with ``teacher_engine = "remote"`` trains on the fleet's scores
    (its start loads the teacher's weights into the members)."""
    import anyio
    import torch

    from corun.contract.engine import Generation, ScoringRefused
    from corun.engines.fleet import FleetEngine
    from trainers.hf.policy import ChatFormat, load_policy
    from trainers.hf.rl import to_rollouts
    from trainers.hf.tasks import eval_problems
    from trainers.lm.policy import rollout_logprobs

    policy, tokenizer = load_policy("tiny-llama", "the members' model")
    chat = ChatFormat(tokenizer)
    prompts = [chat.encode(e.prompt) for e in eval_problems(4)]
    replies = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [2]]
    with anyio.fail_after(120):
        engine = await FleetEngine.connect(
            [s.url for s in fleet], request_timeout_s=60, fleet_timeout_s=10, bucket_mb=64
        )
        scores = await engine.score(prompts, replies)
        with pytest.raises(ScoringRefused, match="whole rows"):
            await engine.distributions(prompts, replies)
    generations = [Generation(r, [0.0] * len(r), [0] * len(r), "stop") for r in replies]
    with torch.no_grad():
        recomputed, _, _ = rollout_logprobs(policy, to_rollouts(prompts, generations, 0), 1.0)
    for row, score in enumerate(scores):
        assert len(score) == len(replies[row])
        torch.testing.assert_close(torch.tensor(score), recomputed[row, : len(score)],
                                   atol=1e-5, rtol=0)  # fmt: skip
    urls = ", ".join(f'"{s.url}"' for s in fleet)
    config = tmp_path / "distill.toml"
    config.write_text(
        f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 2\n\n[log]\nprogress = "off"\n\n'
        "[loop]\nbaseline_eval = false\neval_interval = 0\n\n[data]\nbatch_size = 2\n\n"
        '[trainer]\nkind = "hf_distill"\nmodel = "tiny-llama"\nteacher = "tiny-llama"\n'
        'teacher_engine = "remote"\ndistill_kl = "sampled"\nsamples_per_prompt = 2\n'
        "max_new_tokens = 4\neval_size = 4\n\n"
        f"[trainer.teacher_engine_options]\nurls = [{urls}]\n"
    )
    with anyio.fail_after(300):
        done = await anyio.run_process(
            [sys.executable, "-m", "corun", "train", str(config)], cwd=tmp_path, env=ENV,
            check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    steps = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 2 and all("distill/reverse_kl" in r for r in steps)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_in_flight_updates_need_every_member_to_take_them(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A fleet under ``inflight_at_sync = "interrupt"`` refuses a member that drains
    (one line naming it and the setting); a member served with it says so in
    ``/health``, and a generation through the fleet then spans an update in flight:
    its tokens carry the versions before and after, in order."""
    import anyio

    from corun.contract.engine import EngineError, Sampling
    from corun.engines.fleet import FleetEngine
    from trainers.hf.policy import load_policy

    in_flight = ("trainer.inflight_at_sync=interrupt", 'loop.version_schedule="free"')
    drains, takes = Server(tmp_path), Server(tmp_path, extra=in_flight)
    settings: dict[str, Any] = {"request_timeout_s": 60, "fleet_timeout_s": 10, "bucket_mb": 64}
    try:
        with anyio.fail_after(120):
            with pytest.raises(EngineError, match=f"fleet member {drains.url} drains"):
                await FleetEngine.connect([drains.url, takes.url], interrupt=True, **settings)
            engine = await FleetEngine.connect([takes.url], interrupt=True, **settings)
            assert engine.interrupts
            weights = load_policy("tiny-llama", "the members' model")[0].weights()
            await engine.update_weights(weights, 1)
            made: list[Any] = []

            async def generate() -> None:
                made.extend(await engine.generate([[5, 6, 7]] * 16, Sampling(max_tokens=240), 0))

            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await anyio.sleep(0.1)  # 240 steps of 16 rows on the local engine: seconds
                await engine.update_weights(weights, 2)
                assert not made, "the update waited for the generation (drained)"
        for generation in made:
            assert generation.versions == sorted(generation.versions)
            assert set(generation.versions) == {1, 2}, generation.versions
    finally:
        drains.stop(signal.SIGKILL)
        takes.stop(signal.SIGKILL)
