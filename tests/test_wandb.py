"""wandb offline: the logging run takes corun's run id, a resumed run reattaches to
it, and wandb's service process is gone when ``run`` returns."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

import corun
from corun.events import read_jsonl
from tests.conftest import make_config
from tests.fakes import FakeTrainer


def _children() -> list[str]:
    out = subprocess.run(
        ["ps", "--ppid", str(os.getpid()), "-o", "pid=,args="], capture_output=True, text=True
    ).stdout
    return [line for line in out.splitlines() if "ps --ppid" not in line]


def test_offline_run_reattaches_and_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    for steps in (2, 4):
        config = make_config(
            run_dir, {"kind": "tests.fakes:FakeTrainer"}, run={"steps": steps},
            log={"wandb": "offline"},
        )  # fmt: skip
        anyio.run(corun.run, FakeTrainer(config), config)
        assert _children() == []
    run_ids = {r["run_id"] for r in read_jsonl(run_dir / "events.jsonl")
               if r["event"] == "start"}  # fmt: skip
    assert len(run_ids) == 1
    run_id = run_ids.pop()
    # Both the first and the resumed process logged to the wandb run with corun's id.
    offline_runs = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2
    assert all(run_id in name for name in offline_runs)
