"""Sharded training under torchrun (``run.parallel = "fsdp"``, 2 CPU ranks, gloo) and
its checkpoints, against one process:

- every family's kinds at 2 ranks with FSDP2 equal one process on the same global
  batch within test_distributed's tolerances (the ``ddp`` strategy, FSDP2 on a
  replicate mesh, is test_distributed's own run of every kind);
- a sharded checkpoint (each rank writes its shards) resumes at 1 process, and a
  1-process checkpoint at 2 sharded ranks, equal to the straight runs;
- a rank SIGKILLed while the ranks write their shards leaves the previous checkpoint
  whole: it reads back and a run resumes from it;
- ``run.parallel = "fsdp"`` for a kind whose model does not shard is refused in one line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

from corun.records import checkpoint
from tests.support.corun_process import CorunRun
from tests.support.matrix import params
from tests.support.processes import REPO
from tests.test_distributed import (
    KINDS,
    OTHER_KINDS,
    STEPS,
    _assert_gone,
    _assert_same,
    _one_process,
    _run_processes,
    _tables,
    _two_ranks,
)
from trainers.hf.tiny import build, built_in

pytestmark = pytest.mark.slow


ALL_KINDS = {**KINDS, **OTHER_KINDS}  # test_distributed's: sft and grpo are TinyLM's
# Every kind with a sharded model: hf policies, TinyLM, the agentic policy, FlowDiT, the
# prompt enhancer and the unified model (whose image track is a FlowDiT entered directly).
SHARDED_KINDS = ["hf_sft", "hf_grpo", "grpo", "unified", "sft", "agentic_ppo", "flow_grpo",
                 "pe", "pe_warmup", "flow_pretrain"]  # fmt: skip
# CI shards one kind of each model (the RL ones); `-m long` adds the other kinds.
LONG_SHARDED = ("hf_sft", "sft", "pe_warmup", "flow_pretrain")
# hf_grpo's updates: windows of 2 batches, clipped to a global norm they exceed (~1),
# so accumulation and the clip over every shard count. (Mini-batches slice each rank's
# shard, so one process's same-sized mini-batch holds other rows: not comparable.)
WINDOWS = {"accumulate": 2}


def _sharded(kind: str, run_dir: Path, **run: Any) -> dict[str, Any]:
    """The tables of test_distributed's run of ``kind``, sharded."""
    tables = _tables(_trainer(kind), run_dir)
    tables["run"].update(parallel="fsdp", **run)
    if kind == "hf_grpo":
        tables["loop"].update(WINDOWS)
    return tables


def _trainer(kind: str) -> dict[str, Any]:
    _, trainer = ALL_KINDS[kind]
    extra = {"grad_clip": 0.05} if kind == "hf_grpo" else {}
    if "model" in trainer:
        extra["model"] = f"hf:{built_in().resolve()}"
    return {**trainer, **extra}


async def _one(kind: str, run_dir: Path) -> None:
    cls, _ = ALL_KINDS[kind]
    loop = WINDOWS if kind == "hf_grpo" else {}
    dtype = torch.get_default_dtype()
    try:  # pe's set-up makes float64 the default
        await _one_process(kind, run_dir, {kind: (cls, _trainer(kind))}, loop)
    finally:
        torch.set_default_dtype(dtype)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the 2-rank run is a subprocess
@pytest.mark.parametrize("kind", params(SHARDED_KINDS, LONG_SHARDED))
async def test_sharded_ranks_equal_one_process(
    tmp_path: Path, anyio_backend: str, kind: str
) -> None:
    _two_ranks(_sharded(kind, tmp_path / "two"), tmp_path / "cfg.toml")
    shards = checkpoint.step_dir(tmp_path / "two", STEPS) / "shards"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    await _one(kind, tmp_path / "one")
    _assert_same(tmp_path / "two", tmp_path / "one")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sharded_checkpoints_resume_across_world_sizes(
    tmp_path: Path, anyio_backend: str
) -> None:
    """2 sharded ranks → 1 process, and 1 process → 2 sharded ranks, from step 2 of 4."""
    _two_ranks(_sharded("hf_grpo", tmp_path / "two"), tmp_path / "cfg.toml")
    await _one("hf_grpo", tmp_path / "one")

    at_one = _copy_to_step_2(tmp_path / "two", tmp_path / "two-then-one")
    await _one("hf_grpo", at_one)
    _assert_same(at_one, tmp_path / "two")

    at_two = _copy_to_step_2(tmp_path / "one", tmp_path / "one-then-two")
    _two_ranks(_sharded("hf_grpo", at_two), tmp_path / "cfg2.toml")
    _assert_same(at_two, tmp_path / "one")


def _copy_to_step_2(straight: Path, into: Path) -> Path:
    shutil.copytree(straight, into)
    shutil.rmtree(checkpoint.step_dir(into, STEPS))
    return into


def test_a_rank_killed_while_writing_shards_leaves_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    model = build(tmp_path / "model", hidden=384, layers=6)  # shards of ~20 MB per rank
    tables = _sharded("hf_sft", tmp_path / "run", steps=10_000)
    tables["trainer"]["model"] = f"hf:{model}"
    tables["loop"].update(save_interval=1, eval_interval=0)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(tables))
    proc = subprocess.Popen(
        [sys.executable, "-m", "corun", "train", str(cfg), "run.nproc=2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"},
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.txt", "wb"),
    )  # fmt: skip
    try:
        run = CorunRun(proc, tmp_path, tmp_path / "run")
        run.wait_event("checkpoint_written")
        pids = _run_processes(run)
        rank1 = next(p for p in pids[1:] if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes())
        _kill_while_writing(tmp_path / "run", rank1)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_gone(pids)
    # Every complete checkpoint reads back whole; the newest resumes a run.
    newest = checkpoint.latest(tmp_path / "run")
    assert newest is not None
    checkpoint.read_whole(newest)
    tables["run"].update(steps=checkpoint.read(newest)[0].step + 1, nproc=1)
    tables["checkpoint"] = {"resume": True}
    cfg.write_text(tomli_w.dumps(tables))
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg)], cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"},
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(checkpoint.checkpoints_dir(tmp_path / "run").glob(".tmp-*"))


def _kill_while_writing(run_dir: Path, pid: int) -> None:
    """SIGKILL ``pid`` once a rank's shard file of a new checkpoint has bytes on disk."""
    root = checkpoint.checkpoints_dir(run_dir)

    def writing() -> bool:
        return any(p.stat().st_size > 0 for p in root.glob(".tmp-step-*/shards/*.distcp"))

    deadline = time.monotonic() + 60
    while not writing():
        assert time.monotonic() < deadline, "no shard write seen"
        time.sleep(0.0005)
    os.kill(pid, signal.SIGKILL)


def test_fsdp_for_a_kind_that_does_not_shard_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    kind = "tests.support.dp_trainers:UnshardedSFT"
    cfg.write_text(tomli_w.dumps({"trainer": {"kind": kind}, "run": {"nproc": 2}}))
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg), "run.parallel=fsdp"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "`$.run.parallel`" in lines[0], lines
    assert not list(tmp_path.glob("runs/*/checkpoints"))
