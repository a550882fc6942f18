"""wandb offline: the logging run takes corun's run id, a resumed run reattaches to
it, and wandb's service process is gone when ``run`` returns."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

import corun
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import FakeTrainer


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
    before = set(_children())  # earlier tests' (multiprocessing's resource tracker)
    for steps in (2, 4):
        config = make_config(
            run_dir, {"kind": "tests.support.fakes:FakeTrainer"}, run={"steps": steps},
            log={"wandb": "offline"},
        )  # fmt: skip
        anyio.run(corun.run, FakeTrainer(config), config)
        assert set(_children()) <= before, "the run left a process (wandb's service?)"
    run_ids = {r["run_id"] for r in read_records(run_dir / "events.jsonl")
               if r["event"] == "start"}  # fmt: skip
    assert len(run_ids) == 1
    run_id = run_ids.pop()
    # Both the first and the resumed process logged to the wandb run with corun's id.
    offline_runs = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2
    assert all(run_id in name for name in offline_runs)


class ImageTrainer(FakeTrainer):
    """Evaluates to a picture: the path goes to metrics.jsonl, the image to wandb."""

    def _evaluate(self, step: int) -> dict[str, float | corun.Image]:  # type: ignore[override]
        from PIL import Image as PILImage

        path = self.run_config.run_dir / f"samples-{step}.png"
        PILImage.new("RGB", (8, 8), (255, 0, 0)).save(path)
        return {"eval/weight_norm": 1.0, "eval/samples": corun.Image(path, caption=f"step {step}")}


def test_images_go_to_metrics_and_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = make_config(
        tmp_path, {"kind": "tests.test_wandb:ImageTrainer"}, run={"steps": 2},
        loop={"eval_interval": 2}, log={"wandb": "offline"},
    )  # fmt: skip
    anyio.run(corun.run, ImageTrainer(config), config)
    logged = [
        r["eval/samples"] for r in read_records(tmp_path / "metrics.jsonl") if "eval/samples" in r
    ]
    assert logged == [str(tmp_path / "samples-0.png"), str(tmp_path / "samples-2.png")]
    media = list((tmp_path / "wandb").glob("offline-run-*/files/media/images/**/*.png"))
    assert len(media) == 2
