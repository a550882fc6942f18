"""A run directory belongs to one trainer kind, must be writable, and survives a full
disk: real ``corun train`` subprocesses on a real (tmpfs) file system."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

from corun.records import checkpoint
from tests.support.cli import assert_usage_error, corun_subprocess, listing

SMALL = {"task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 8}
SFT = {"kind": "sft", **SMALL}
GRPO = {"kind": "grpo", **SMALL, "samples_per_prompt": 4}


def _train(tmp_path: Path, run_dir: Path, trainer: dict[str, object], *overrides: str) -> (
    subprocess.CompletedProcess[str]
):  # fmt: skip
    cfg = tmp_path / f"{trainer['kind']}.toml"
    tables = {
        "run": {"dir": str(run_dir), "steps": 2},
        "loop": {"save_interval": 2, "baseline_eval": False, "eval_interval": 0},
        "data": {"batch_size": 4},
        "log": {"progress": "off"},
        "trainer": trainer,
    }
    cfg.write_text(tomli_w.dumps(tables))
    return corun_subprocess(tmp_path, "train", str(cfg), *overrides)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("sft")
    done = _train(tmp_path, tmp_path / "run", SFT)
    assert done.returncode == 0, done.stderr
    return tmp_path / "run"


def test_another_kind_cannot_resume_a_run_dir(sft_run: Path, tmp_path: Path) -> None:
    before = listing(sft_run)
    done = _train(tmp_path, sft_run, GRPO, "checkpoint.resume=true", "run.steps=4")
    line = assert_usage_error(done.returncode, done.stderr, str(sft_run / "checkpoints"))
    assert "trainer kind 'sft', not 'grpo'" in line and "trainer.init_from" in line, line
    assert listing(sft_run) == before, "a refused resume changed the run directory"
    # What the line suggests works: a warm start from the SFT checkpoint in a new dir.
    latest = checkpoint.latest(sft_run)
    warm = {**GRPO, "init_from": str(latest)}
    done = _train(tmp_path, tmp_path / "grpo", warm)
    assert done.returncode == 0, done.stderr
    state, _ = checkpoint.read(tmp_path / "grpo" / "checkpoints" / "step-2")
    assert state.trainer_kind == "grpo" and state.step == 2


def test_a_format_2_checkpoint_still_resumes(sft_run: Path, tmp_path: Path) -> None:
    """Checkpoints written before kinds were recorded resume (the kind is not checked)."""
    run_dir = tmp_path / "run"
    shutil.copytree(sft_run, run_dir)
    state_file = run_dir / "checkpoints" / "step-2" / checkpoint.STATE_FILE
    state = json.loads(state_file.read_text())
    assert state.pop("trainer_kind") == "sft"
    state_file.write_text(json.dumps({**state, "format": 2}))
    done = _train(tmp_path, run_dir, SFT, "checkpoint.resume=true", "run.steps=3")
    assert done.returncode == 0, done.stderr
    assert (
        checkpoint.read(run_dir / "checkpoints" / "step-3")[0].format == checkpoint.FORMAT_VERSION
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (this machine's tests run as root; CI's too)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    )
    assert done.returncode == 0, f"cannot mount a tmpfs: {done.stderr!r}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_read_only_run_dir_is_refused_at_start(small_disk: Path, tmp_path: Path) -> None:
    run_dir = small_disk / "run"
    run_dir.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    done = _train(tmp_path, run_dir, SFT)
    assert_usage_error(done.returncode, done.stderr, "$.run.dir", "not writable")
    assert list(run_dir.iterdir()) == []


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(
    small_disk: Path, tmp_path: Path
) -> None:
    run_dir = small_disk / "run"
    done = _train(tmp_path, run_dir, SFT)
    assert done.returncode == 0, done.stderr
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "step-2").iterdir())
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (free - size // 2))  # room for records, not a checkpoint

    done = _train(tmp_path, run_dir, SFT, "checkpoint.resume=true", "run.steps=4")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == (
        "corun: error: checkpoint step-4 not written (No space left on device); step-2 is "
        "intact (resume from it with checkpoint.resume=true)"
    ), lines
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-2"]
    checkpoint.read(run_dir / "checkpoints" / "step-2")
    # Space freed, the run goes on from step-2 to the end.
    filler.unlink()
    done = _train(tmp_path, run_dir, SFT, "checkpoint.resume=true", "run.steps=4")
    assert done.returncode == 0, done.stderr
    assert checkpoint.read(run_dir / "checkpoints" / "step-4")[0].step == 4
