"""Resume parity: 8 steps straight == 4 steps, then a resumed run to 8 — bitwise
weights and optimizer state, identical metrics and batches for steps 5–8 — and the
same after an interrupt mid-run (save on interrupt). The first step after a resume
syncs, the data cursor seeks directly, and the logging run id is reattached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import FakeTrainer
from tests.support.state import assert_state_equal

pytestmark = pytest.mark.anyio

FAKE = {"kind": "tests.support.fakes:FakeTrainer"}


def _trainer(run_dir: Path, steps: int, trainer: dict[str, Any] = FAKE) -> FakeTrainer:
    config = make_config(run_dir, trainer, run={"steps": steps}, loop={"save_interval": 2})
    return FakeTrainer(config)


def _training_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Per-step records without timings (which differ between runs)."""
    return [
        {k: v for k, v in record.items() if not k.startswith("perf/")}
        for record in read_records(run_dir / "metrics.jsonl")
        if "train/loss" in record
    ]


async def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "straight", 8)
    with anyio.fail_after(60):
        await corun.run(straight, straight.run_config)
        first = _trainer(tmp_path / "split", 4)
        await corun.run(first, first.run_config)
        resumed = _trainer(tmp_path / "split", 8)
        await corun.run(resumed, resumed.run_config)

    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert _training_metrics(tmp_path / "straight") == _training_metrics(tmp_path / "split")
    # Direct seek: the resumed run rolled out indexes 4..7 only, and synced first.
    assert resumed.calls[:4] == ["setup", "load_state_dict", "sync:4", "rollout:4"]
    assert [c for c in resumed.calls if c.startswith("rollout")] == [
        f"rollout:{i}" for i in range(4, 8)
    ]
    starts = [r for r in read_records(tmp_path / "split" / "events.jsonl") if r["event"] == "start"]
    assert len(starts) == 2 and starts[0]["run_id"] == starts[1]["run_id"]
    assert starts[1]["resumed"] is True
    sync = [r for r in read_records(tmp_path / "split" / "events.jsonl") if r["event"] == "sync"]
    assert {"step": 4, "forced": True}.items() <= sync[4].items()


async def test_resume_after_interrupt_equals_uninterrupted(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "straight", 8)
    with anyio.fail_after(60):
        await corun.run(straight, straight.run_config)

        # Interrupt inside step 6's train call: step 5 is the last complete step, and
        # not on the save interval, so only the save on interrupt can hold it.
        slow = {**FAKE, "slow_in": "train", "slow_s": 0.05}
        first = _trainer(tmp_path / "split", 8, slow)
        control = corun.RunControl()
        async with anyio.create_task_group() as tg:

            async def stop_in_step_6() -> None:
                await first.calls.reached("train:5")
                control.stop("interrupted", signal="SIGINT")

            tg.start_soon(stop_in_step_6)
            outcome = await corun.run(first, first.run_config, control=control)
        assert outcome.reason == "interrupted" and outcome.step == 5

        resumed = _trainer(tmp_path / "split", 8, slow)
        await corun.run(resumed, resumed.run_config)

    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert _training_metrics(tmp_path / "straight") == _training_metrics(tmp_path / "split")


async def test_finished_run_resumes_to_nothing(tmp_path: Path) -> None:
    done = _trainer(tmp_path / "run", 2)
    with anyio.fail_after(30):
        await corun.run(done, done.run_config)
        again = _trainer(tmp_path / "run", 2)
        outcome = await corun.run(again, again.run_config)
    assert outcome.reason == "done" and outcome.step == 2
    assert not [c for c in again.calls if c.startswith(("rollout", "train"))]


async def test_trace_is_valid_json_across_a_resume(tmp_path: Path) -> None:
    import json

    with anyio.fail_after(30):
        for steps in (2, 4):
            trainer = _trainer(tmp_path / "run", steps)
            await corun.run(trainer, trainer.run_config)
    events = json.loads((tmp_path / "run" / "trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans if e["name"] == "train"] == [1, 2, 3, 4]
    assert all(e["dur"] >= 0 for e in spans)
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"producer", "trainer"} <= tracks


async def test_checkpoint_written_on_a_gpu_resumes_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints load onto the run's device: a checkpoint whose tensors were saved
    from CUDA (their storage tagged ``cuda:0``, which torch cannot load on a machine
    without CUDA unless mapped) resumes here exactly as the CPU's own. Made by
    re-saving step 4's tensors with torch's location tag set to ``cuda:0``: this
    machine cannot make real CUDA storage. The other way (a CPU checkpoint onto a GPU)
    is the same load followed by ``load_state_dict`` into the run's device-resident
    modules and optimizers (torch copies and casts to each parameter's device): it has
    not run here."""
    straight = _trainer(tmp_path / "straight", 8)
    first = _trainer(tmp_path / "split", 4)
    with anyio.fail_after(60):
        await corun.run(straight, straight.run_config)
        await corun.run(first, first.run_config)
    saved = tmp_path / "split" / "checkpoints" / "step-4" / checkpoint.TENSORS_FILE
    tensors = torch.load(saved, weights_only=True)
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(tensors, saved)
    with pytest.raises(RuntimeError, match="CUDA"):  # the file now claims CUDA storage
        torch.load(saved, weights_only=True)
    resumed = _trainer(tmp_path / "split", 8)
    with anyio.fail_after(60):
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert _training_metrics(tmp_path / "straight") == _training_metrics(tmp_path / "split")
