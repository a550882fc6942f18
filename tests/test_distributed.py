"""Data-parallel training under torchrun: 2 CPU ranks (gloo) against one process.

- the update at world size 2 equals the one-process update on the same global batch
  within TOLERANCE, for every built-in kind (tests/support/dp_trainers.py: trainers
  whose global batch is the same at any world size): not bitwise, because the mean of
  two ranks' gradients sums in another order than one backward over the whole batch
  (and each rank pads its shard to its own length);
- resume 2 → 1 equals the straight 2-rank run within TOLERANCE, 2 → 2 bitwise;
- the settings a rank cannot apply to its shard alone (whole-batch advantages, random
  trained steps) are refused with one line, before any step;
- Ctrl-C to the launcher: every rank tears down in the documented order, exit 130,
  no process of the run left; a rank killed with SIGKILL fails the run in one line
  well within the collective timeout, a hung one within it.

The 2-rank runs are real ``corun train ... run.nproc=2`` subprocesses (torchrun under
them); the one-process runs are in-process (sft and grpo on asyncio and trio).

``pe`` trains in float64 at both world sizes. In float32 they part on rounding alone,
through Adam: a colour token that no rewrite of the batch chose has an exact-zero
gradient in real arithmetic (the grammar allows it at the colour position only, whose
distribution every rewrite of a group shares, and the group's advantages sum to 0)
that float32 computes as noise of 1e-12..1e-9, depending on the order of the sums (two
halves or one batch: the loss summed half by half at world size 1 gives the 2-rank
numbers). AdamW moves that element by lr · g / (|g| + 1e-8), up to 4e-4 at lr 1e-2,
and the changed policy can later sample another rewrite. Measured in float32 beyond
the weight tolerance: 1 of 9 seeds with this config, 2 of 13 with the pe defaults. In
float64 the same runs agree to 2e-11, so an error of the data-parallel bookkeeping (a
per-rank statistic, a mean over a shard, a draw) shows.
"""

from __future__ import annotations

import contextlib
import os
import re
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
from corun.execution.distributed import World
from corun.records import checkpoint
from corun.scale.launch import children
from tests.support.config import make_config
from tests.support.corun_process import CorunRun, assert_teardown_order
from tests.support.dp_trainers import (
    TwoShardAgentic,
    TwoShardAgenticPPO,
    TwoShardFlowGRPO,
    TwoShardFlowPretrain,
    TwoShardGRPO,
    TwoShardHFGRPO,
    TwoShardHFPPO,
    TwoShardPE,
    TwoShardPEWarmup,
    TwoShardPPO,
    TwoShardUnified,
    TwoShardUnifiedPretrain,
)
from tests.support.loops import step_records
from tests.support.matrix import params
from tests.support.processes import REPO, wait_until
from trainers import pg
from trainers.agentic.sft import AgenticSFTTrainer
from trainers.diffusion import flow_rl
from trainers.hf.sft import HFSFTTrainer
from trainers.hf.tiny import built_in
from trainers.lm.sft import SFTTrainer
from trainers.pe.rl import PromptEnhancerTrainer
from trainers.unified import UnifiedTrainer

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # losses, rewards, gradient norms
# Weights after 4 AdamW steps at lr 1e-2: Adam divides each gradient by its own
# magnitude, so an element whose gradient is at the rounding level moves by up to lr
# either way; measured up to 4e-5.
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 2e-4}
SMALL = {"task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 16}
Kind = tuple[type[corun.Trainer[Any]], dict[str, Any]]
Kinds = dict[str, Kind]


def _two_shard(cls: type[corun.Trainer[Any]], **trainer: Any) -> Kind:
    """A test trainer of tests/support/dp_trainers.py and its table, which names it by
    path (a rank imports it from there)."""
    return cls, {"kind": f"{cls.__module__}:{cls.__name__}", **trainer}


# Each 2-rank run once for the module (the resume tests start from grpo's).
KINDS: Kinds = {
    "sft": (SFTTrainer, {"kind": "sft", **SMALL}),
    "grpo": _two_shard(
        TwoShardGRPO, **SMALL, samples_per_prompt=4, truncated_reward="keep", lr=1e-2
    ),
}
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
    _, tensors = checkpoint.read_whole(checkpoint.step_dir(run_dir, step))
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


async def _one_process(
    kind: str, run_dir: Path, kinds: Kinds | None = None, loop: dict[str, Any] | None = None
) -> None:
    cls, trainer = (kinds or KINDS)[kind]
    tables = _tables(trainer, run_dir)
    tables.pop("trainer")
    tables["run"].pop("dir")
    tables["loop"].update(loop or {})
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


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the 2-rank run is a subprocess
async def test_two_ranks_split_by_the_token_budget_equal_one_unsplit(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Each rank cuts its shard of 8 rows (8 to 14 tokens) into chunks of at most 40
    tokens (about four: the ranks agree on the count), dividing by the token count of
    both ranks' whole batch: the run is the unsplit one-process run."""
    _, trainer = KINDS["grpo"]
    tables = _tables(trainer, tmp_path / "two")
    tables["loop"]["micro_batch_tokens"] = 40
    _two_ranks(tables, tmp_path / "cfg.toml")
    await _one_process("grpo", tmp_path / "one", loop={"micro_batch_tokens": 0})
    _assert_same(tmp_path / "two", tmp_path / "one")


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


# ----------------------------------------------------------------------------- every other kind

RL = {"samples_per_prompt": 4, "lr": 1e-2}
TINY_AGENT = {"d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 8}
AGENT = {**TINY_AGENT, **RL}
HF = {"model": "tiny-llama", "eval_size": 4, "max_new_tokens": 6}
HF_RL = {**HF, **RL, "rewards": {"tests.test_hf:letter_share": 1.0}, "truncated_reward": "keep"}
FLOW = {
    "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 4, "grid_size": 0, "sample_steps": 3,
}  # fmt: skip
FLOW_GRPO = {**FLOW, "lr": 1e-2, "grpo": {"samples_per_prompt": 4, "clip_range": 0.2}}
PE = {**FLOW, "text_d_model": 32, "text_n_layers": 1, "text_n_heads": 2, "text_lr": 1e-2}
PE_RL = {**PE, "lr": 1e-2, "grpo": {"samples_per_prompt": 4, "clip_range": 0.2}}
# Addition: answers of 1 to 3 digits, so the ranks' shards hold different token counts
# (a text mean over a rank's own count shows) and pad to different lengths.
SHAPE = {
    "task": "addition", "d_model": 32, "n_heads": 2, "n_layers": 1, "sample_steps": 3,
    "grid_size": 0, "text_eval_size": 16, "image_eval_size": 4, "lr": 1e-2,
}  # fmt: skip
# Both tracks weighted unequally, so a track's mean over the wrong count shows.
WEIGHTS = {"text_weight": 0.5, "image_weight": 2.0}
UNIFIED_RL = {
    "text": {"samples_per_prompt": 4},
    # The first 2 of 3 steps (the trained steps are the same on every rank); a KL term,
    # the image track's second shared mean.
    "image": {"samples_per_prompt": 4, "timestep_fraction": 0.5, "kl_coef": 0.5},
}
OTHER_KINDS: Kinds = {
    "ppo": _two_shard(TwoShardPPO, **SMALL, **RL, truncated_reward="keep"),
    "agentic_sft": (
        AgenticSFTTrainer,
        {"kind": "agentic_sft", **TINY_AGENT, "demonstrations": 16},
    ),
    "agentic": _two_shard(TwoShardAgentic, **AGENT),
    "agentic_ppo": _two_shard(TwoShardAgenticPPO, **AGENT),
    "hf_sft": (HFSFTTrainer, {"kind": "hf_sft", **HF, "lr": 1e-2}),
    "hf_grpo": _two_shard(TwoShardHFGRPO, **HF_RL),
    "hf_ppo": _two_shard(TwoShardHFPPO, **HF_RL),
    "flow_pretrain": _two_shard(TwoShardFlowPretrain, **FLOW, lr=1e-2),
    "flow_grpo": _two_shard(TwoShardFlowGRPO, **FLOW_GRPO),
    "pe_warmup": _two_shard(TwoShardPEWarmup, **PE),
    "pe": _two_shard(TwoShardPE, **PE_RL),  # in float64: see the module's docstring
    # Both tracks' losses in one optimizer step.
    "unified_pretrain": _two_shard(TwoShardUnifiedPretrain, **SHAPE, **WEIGHTS),
    "unified": _two_shard(TwoShardUnified, **SHAPE, **WEIGHTS, **UNIFIED_RL),
}


# CI runs the RL kind of each family (with KINDS' sft and grpo): their runs hold the
# family's model, data sharding and update; `-m long` adds the others.
LONG_KINDS = ("ppo", "agentic_sft", "agentic_ppo", "hf_sft", "hf_ppo", "flow_pretrain",
              "pe_warmup", "unified_pretrain")  # fmt: skip


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the 2-rank run is a subprocess
@pytest.mark.parametrize("kind", params(OTHER_KINDS, LONG_KINDS))
async def test_every_other_kind_two_ranks_equal_one_process(
    tmp_path: Path, anyio_backend: str, kind: str
) -> None:
    cls, trainer = OTHER_KINDS[kind]
    if "model" in trainer:  # built once, here: not by each rank in the run's directory
        trainer = {**trainer, "model": f"hf:{built_in().resolve()}"}
    _two_ranks(_tables(trainer, tmp_path / "two"), tmp_path / "cfg.toml")
    dtype = torch.get_default_dtype()
    try:  # pe's set-up makes float64 the default
        await _one_process(kind, tmp_path / "one", {kind: (cls, trainer)})
    finally:
        torch.set_default_dtype(dtype)
    _assert_same(tmp_path / "two", tmp_path / "one")


# ----------------------------------------------------------------------------- refused settings

REFUSED = {  # what a rank cannot apply to its shard alone: (trainer, table, setting)
    "unified-text.adv_scope": (
        UnifiedTrainer, {"kind": "unified", **SHAPE, "text": {"adv_scope": "batch"}},
        "text.adv_scope",
    ),
    "unified-image.timestep_choice": (
        UnifiedTrainer,
        {
            "kind": "unified", **SHAPE,
            "image": {"timestep_fraction": 0.5, "timestep_choice": "random"},
        },
        "image.timestep_choice",
    ),
    "unified-image.adv_scope": (
        UnifiedTrainer, {"kind": "unified", **SHAPE, "image": {"adv_scope": "batch"}},
        "image.adv_scope",
    ),
    "pe-grpo.adv_scope": (  # both tracks' advantages
        PromptEnhancerTrainer, {"kind": "pe", **PE, "grpo": {"adv_scope": "batch"}},
        "grpo.adv_scope",
    ),
    "pe-grpo.timestep_choice": (
        PromptEnhancerTrainer,
        {"kind": "pe", **PE, "grpo": {"timestep_fraction": 0.5, "timestep_choice": "random"}},
        "grpo.timestep_choice",
    ),
}  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(REFUSED))
async def test_whole_batch_settings_are_refused_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str, case: str
) -> None:
    """What a rank cannot apply to its shard alone: one line, before any step."""
    cls, trainer, refused = REFUSED[case]
    for module in (pg, flow_rl):
        monkeypatch.setattr(module, "world", lambda: World(0, 2))
    config = make_config(tmp_path, trainer)
    with pytest.raises(corun.ConfigError, match=rf"`\$\.trainer\.{re.escape(refused)}`"):
        await corun.run(cls(config), config)
    assert not os.listdir(tmp_path)  # a refused start leaves its run dir as it was


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
    def alive() -> list[int]:  # zombies too: the launcher must have reaped them
        return [pid for pid in pids if Path(f"/proc/{pid}").exists()]

    wait_until(lambda: not alive(), 5.0)
    left = alive()
    assert not left, f"processes of the run left: {left}"


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
def test_a_stop_sent_to_every_process_at_once_is_one_stop(
    start_corun: Callable[..., CorunRun], tmp_path: Path
) -> None:
    """As a batch system stops a job (Slurm's ``scancel --signal=INT``, its ``--signal``
    before the time limit): SIGINT to the launcher, torchrun's agent and every rank at
    once. Each rank counts the copies it gets (direct, and passed on by the agent) as
    one stop: it saves, exits 130, and no traceback is printed."""
    run = _start_two_ranks(start_corun, "asyncio")
    pids = _run_processes(run)
    for pid in [run.proc.pid, *pids]:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.05)
    for pid in pids:  # the copies the launcher and the agent pass on, a moment later
        os.kill(pid, signal.SIGINT)
    assert run.wait_exit() == 130, run.stderr()
    assert "Traceback" not in run.stderr() and "Logging error" not in run.stderr(), run.stderr()
    assert "skipping optional teardown steps" not in run.stderr()
    events = run.events()
    assert events[-1]["reason"] == "interrupted"
    assert "teardown:save" in [e["event"] for e in events]
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
        tomli_w.dumps({"trainer": {"kind": "tests.support.fakes:FakeTrainer"}, "run": {"nproc": 2}})
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
    wait_until(lambda: not _groups_alive(pids), 5.0)
    left = _groups_alive(pids)
    assert not left, f"processes of the run left: {left}"
