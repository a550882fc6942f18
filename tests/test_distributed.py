"""Data-parallel training under torchrun: 2 CPU ranks (gloo) against one process.

- the update at world size 2 equals the one-process update on the same global batch
  (SFT; GRPO with ``tests.dp_trainers:TwoShardGRPO``, whose global batch is the same at
  any world size) within TOLERANCE: not bitwise, because the mean of two ranks'
  gradients sums in another order than one backward over the whole batch (and each
  rank pads its shard to its own length);
- resume 2 → 1 equals the straight 2-rank run within TOLERANCE, 2 → 2 bitwise;
- Ctrl-C to the launcher: every rank tears down in the documented order, exit 130,
  no process of the run left; a rank killed with SIGKILL fails the run in one line
  well within the collective timeout.

The 2-rank runs are real ``corun train ... run.nproc=2`` subprocesses (torchrun under
them); the one-process runs are in-process, on asyncio and trio.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import tomli_w
import torch

import corun
from corun.records import checkpoint
from corun.scale.launch import children
from tests.conftest import make_config
from tests.corun_process import REPO, CorunRun, assert_teardown_order, start_corun
from tests.dp_trainers import TwoShardGRPO
from tests.loops import step_records
from trainers.lm.sft import SFTTrainer

__all__ = ["start_corun"]  # the fixture, used by name
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # losses, rewards, gradient norms
# Weights after 4 AdamW steps at lr 1e-2: Adam divides each gradient by its own
# magnitude, so an element whose gradient is at the rounding level moves by up to lr
# either way; measured up to 4e-5.
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 2e-4}
SMALL = {"task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 16}
KINDS: dict[str, tuple[type[corun.Trainer[Any]], dict[str, Any]]] = {
    "sft": (SFTTrainer, {"kind": "sft", **SMALL}),
    "grpo": (
        TwoShardGRPO,
        {
            "kind": "tests.dp_trainers:TwoShardGRPO", **SMALL, "samples_per_prompt": 4,
            "truncated_reward": "keep", "lr": 1e-2,
        },
    ),
}  # fmt: skip
STEPS = 4


def _tables(trainer: dict[str, Any], run_dir: Path, steps: int = STEPS) -> dict[str, Any]:
    return {
        "trainer": trainer,
        "run": {"dir": str(run_dir), "steps": steps, "seed": 3},
        "loop": {"baseline_eval": False, "save_interval": 2},
        "data": {"batch_size": 4},
        "log": {"progress": "off"},
    }


def _two_ranks(tables: dict[str, Any], cfg: Path) -> None:
    """``corun train cfg run.nproc=2`` to the end."""
    cfg.write_text(tomli_w.dumps(tables))
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg), "run.nproc=2"],
        cwd=cfg.parent, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The straight 2-rank run of each kind (checkpoints at steps 2 and 4)."""
    runs = {}
    for kind, (_, trainer) in KINDS.items():
        root = tmp_path_factory.mktemp(f"{kind}2")
        _two_ranks(_tables(trainer, root / "run"), root / "cfg.toml")
        runs[kind] = root / "run"
    return runs


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every model's weights in the trainer's state (``model``, or each side's, as
    ``text.model.<name>``), keyed by path."""
    _, tensors = checkpoint.read(checkpoint.step_dir(run_dir, step))
    return _models(tensors["trainer"])


def _models(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    if "model" in state:
        return {f"{prefix}{name}": t for name, t in state["model"].items()}
    sides = (_models(v, f"{prefix}{k}.model.") for k, v in state.items() if isinstance(v, dict))
    return {name: t for side in sides for name, t in side.items()}


def _assert_same(got: Path, expected: Path, exact: bool = False) -> None:
    got_records, expected_records = step_records(got), step_records(expected)
    assert [r["step"] for r in got_records] == [r["step"] for r in expected_records]
    for a, b in zip(got_records, expected_records, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], **TOLERANCE, msg=f"{key} at {a['step']}")
    for name, tensor in _weights(expected, STEPS).items():
        if exact:
            assert torch.equal(_weights(got, STEPS)[name], tensor), name
        else:
            torch.testing.assert_close(_weights(got, STEPS)[name], tensor, **WEIGHT_TOLERANCE)


Kinds = dict[str, tuple[type[corun.Trainer[Any]], dict[str, Any]]]


async def _one_process(kind: str, run_dir: Path, kinds: Kinds | None = None) -> None:
    cls, trainer = (kinds or KINDS)[kind]
    tables = _tables(trainer, run_dir)
    tables.pop("trainer")
    tables["run"].pop("dir")
    config = make_config(run_dir, trainer, **tables)
    with anyio.fail_after(120):
        await corun.run(cls(config), config)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_two_ranks_equal_one_process(
    two_rank_runs: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    await _one_process(kind, tmp_path / "run")
    _assert_same(two_rank_runs[kind], tmp_path / "run")


def _resumable_copy(straight: Path, into: Path) -> Path:
    """The straight run as it was after step 2's checkpoint."""
    shutil.copytree(straight, into)
    shutil.rmtree(checkpoint.step_dir(into, STEPS))
    return into


@pytest.mark.slow
@pytest.mark.anyio
async def test_resume_two_ranks_at_one(two_rank_runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = _resumable_copy(two_rank_runs["grpo"], tmp_path / "run")
    await _one_process("grpo", run_dir)
    _assert_same(run_dir, two_rank_runs["grpo"])


@pytest.mark.slow
def test_resume_two_ranks_at_two(two_rank_runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = _resumable_copy(two_rank_runs["grpo"], tmp_path / "run")
    _two_ranks(_tables(KINDS["grpo"][1], run_dir), tmp_path / "cfg.toml")
    _assert_same(run_dir, two_rank_runs["grpo"], exact=True)


# ----------------------------------------------------------------------------- failures


def _start_two_ranks(start: Callable[..., CorunRun], backend: str, **run: Any) -> CorunRun:
    """A long SFT run at 2 ranks, once both ranks have trained a step."""
    corun_run = start(
        {"kind": "sft", **SMALL},
        ("run.nproc=2", f"run.backend={backend}"),
        run={"steps": 10_000, **run},
        loop={"baseline_eval": False},
        data={"batch_size": 4},
    )
    corun_run.wait_event("step")
    return corun_run


def _run_processes(run: CorunRun) -> list[int]:
    """The agent under the launcher, and the ranks under the agent."""
    agents = children(run.proc.pid)
    ranks = [pid for agent in agents for pid in children(agent)]
    assert len(agents) == 1 and len(ranks) == 2, (agents, ranks)
    return agents + ranks


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5.0
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        time.sleep(0.05)
    assert not alive, f"processes of the run left: {alive}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_stops_every_rank_in_order(
    start_corun: Callable[..., CorunRun], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:  # fmt: skip
    monkeypatch.setenv("CORUN_RANK_DIR", str(tmp_path / "ranks"))
    run = _start_two_ranks(start_corun, backend)
    pids = _run_processes(run)
    run.send(signal.SIGINT)
    code = run.wait_exit()

    assert code == 130, run.stderr()
    assert "Traceback" not in run.stderr(), run.stderr()
    for records in (run.run_dir, tmp_path / "ranks" / "rank-1"):
        events = CorunRun(run.proc, tmp_path, records).events()
        assert events[-1]["reason"] == "interrupted", (records, events[-1])
        assert events[-1]["signal"] == "SIGINT"
        names = [e["event"] for e in events]
        assert_teardown_order(names, complete=False)  # SFT has no engine to stop
        assert {"teardown:save", "teardown:checkpoints"} <= set(names), names
    # Rank 1 wrote nothing to the run directory; rank 0 saved on interrupt.
    assert not (tmp_path / "ranks" / "rank-1" / "checkpoints").exists()
    assert checkpoint.latest(run.run_dir) is not None
    _assert_gone(pids)


@pytest.mark.slow
def test_a_killed_rank_fails_the_run(start_corun: Callable[..., CorunRun]) -> None:
    scratch_before = set(Path(tempfile.gettempdir()).glob("corun-rank*"))
    run = _start_two_ranks(start_corun, "asyncio", collective_timeout_s=30)
    pids = _run_processes(run)
    rank1 = next(
        pid for pid in pids[1:] if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
    )
    started = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    code = run.wait_exit(timeout=30)

    assert time.monotonic() - started < 30
    assert code == 1, run.stderr()
    # torchrun reports the killed rank; or rank 0 noticed first, in its collective.
    killed = f"rank 1 (pid {rank1}) was killed by SIGKILL" in run.stderr()
    assert killed or "corun: error: rank 0: " in run.stderr(), run.stderr()
    assert "Traceback" not in run.stderr(), run.stderr()
    _assert_gone(pids)
    # The killed rank could not remove its scratch records; the launcher did.
    assert set(Path(tempfile.gettempdir()).glob("corun-rank*")) <= scratch_before


def test_a_kind_that_cannot_shard_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        tomli_w.dumps({"trainer": {"kind": "tests.fakes:FakeTrainer"}, "run": {"nproc": 2}})
    )
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not support data-parallel training" in lines[0], lines


def _groups_alive(leaders: list[int]) -> list[int]:
    """Live processes in the process groups or sessions led by ``leaders`` (the agent's
    and each rank's own: torchrun starts every rank in a session of its own)."""
    alive = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        in_run = int(entry.name) in leaders or {int(stat[2]), int(stat[3])} & set(leaders)
        if in_run and stat[0] != b"Z":
            alive.append(int(entry.name))
    return alive


HUNG_TIMEOUT_S = 10
HUNG_DEADLINE_S = 5  # run.hard_deadline_s: the agent's grace before SIGKILL after a failure
# After the timeout: the failing rank's teardown and exit, the agent stopping the hung
# rank (SIGTERM cannot move a stopped process: SIGKILL after the grace), the launcher.
HUNG_MARGIN_S = HUNG_DEADLINE_S + 12


@pytest.mark.slow
def test_a_hung_rank_fails_the_run_within_the_timeout(
    start_corun: Callable[..., CorunRun],
) -> None:
    """A rank that hangs (SIGSTOP: alive but silent, unlike a killed one, which torchrun
    notices) fails the run in run.collective_timeout_s plus a bounded margin: exit 1, one
    line naming the collective timeout, no process of the run left."""
    run = _start_two_ranks(
        start_corun, "asyncio", collective_timeout_s=HUNG_TIMEOUT_S, hard_deadline_s=HUNG_DEADLINE_S
    )
    pids = _run_processes(run)
    rank1 = next(
        pid for pid in pids[1:] if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
    )
    started = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    try:
        code = run.wait_exit(timeout=HUNG_TIMEOUT_S + HUNG_MARGIN_S + 30)
        elapsed = time.monotonic() - started
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave it stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, sig)
    assert code == 1, run.stderr()
    assert HUNG_TIMEOUT_S - 1 < elapsed < HUNG_TIMEOUT_S + HUNG_MARGIN_S, (elapsed, run.stderr())
    lines = run.stderr().strip().splitlines()  # nothing from torchrun's agent either
    assert len(lines) == 1, run.stderr()
    assert lines[0].startswith("corun: error: rank 0: ") and "run.collective_timeout_s" in lines[0]
    deadline = time.monotonic() + 5.0
    while (left := _groups_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of the run left: {left}"
