"""The SFT trainer through the template: parity with a hand-written loop, asyncio ==
trio, resume parity, and a short learning test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.loops import handwritten_loop, step_records
from tests.support.state import assert_state_equal
from trainers.lm.sft import SFTTrainer

pytestmark = pytest.mark.anyio

SMALL = {"kind": "sft", "task": "sort", "d_model": 32, "n_heads": 2, "eval_size": 32}


def _config(run_dir: Path, steps: int, **loop: Any) -> corun.Config:
    return make_config(
        run_dir,
        {**SMALL, "micro_batches": 2},
        run={"steps": steps, "seed": 3},
        loop={"eval_interval": 2, **loop},
        data={"batch_size": 16},
    )


async def test_run_equals_handwritten_loop(tmp_path: Path, anyio_backend: str) -> None:
    """Evaluation draws nothing and changes nothing, so the hand-written loop (which
    never evaluates) must match a run with periodic evals, step for step."""
    config = _config(tmp_path / "run", steps=4)
    trainer = SFTTrainer(config)
    with anyio.fail_after(60):
        await corun.run(trainer, config)
    reference, records = handwritten_loop(SFTTrainer, _config(tmp_path / "ref", steps=4))
    assert_state_equal(trainer.state_dict(), reference.state_dict())
    assert step_records(tmp_path / "run") == records


def test_asyncio_equals_trio(tmp_path: Path) -> None:
    states = []
    for backend in ("asyncio", "trio"):
        config = _config(tmp_path / backend, steps=3, compute="inline")
        trainer = SFTTrainer(config)
        anyio.run(corun.run, trainer, config, backend=backend)
        states.append(trainer.state_dict())
    assert_state_equal(*states)


async def test_resume_parity(tmp_path: Path) -> None:
    with anyio.fail_after(120):
        straight = SFTTrainer(_config(tmp_path / "straight", steps=8))
        await corun.run(straight, straight.run_config)
        first = SFTTrainer(_config(tmp_path / "split", steps=4))
        await corun.run(first, first.run_config)
        resumed = SFTTrainer(_config(tmp_path / "split", steps=8))
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert step_records(tmp_path / "straight") == step_records(tmp_path / "split")


async def test_sft_learns(tmp_path: Path) -> None:
    """60 steps of sort: loss and held-out greedy exact match clearly improve."""
    config = make_config(
        tmp_path / "run",
        {"kind": "sft", "task": "sort", "eval_size": 128},
        run={"steps": 60},
        loop={"eval_interval": 60},
        data={"batch_size": 64},
    )
    with anyio.fail_after(120):
        await corun.run(SFTTrainer(config), config)
    evals = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "eval/loss" in r]
    first, last = evals[0], evals[-1]
    assert (first["step"], last["step"]) == (0, 60)
    assert last["eval/loss"] < 0.5 * first["eval/loss"]
    # Chance exact match on 6 sorted digits is ~0; 60 steps reach well above 0.2.
    assert last["eval/accuracy"] > first["eval/accuracy"] + 0.2


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"prompt": "31>", "answer": "13"', "malformed JSON"),
        ('{"prompt": "31>"}', "missing field"),
        ('{"prompt": "ab>", "answer": "ab"}', "character outside the vocabulary"),
    ],
)
def test_bad_data_file_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, why: str
) -> None:
    from corun.host.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "21>", "answer": "12"}\n' * 16 + line + "\n")
    config = tmp_path / "sft.toml"
    config.write_text('[trainer]\nkind = "sft"\nd_model = 32\nn_heads = 2\n')
    code = main(["train", str(config), f"run.dir={tmp_path / 'run'}", f"data.path={data}",
                 "log.progress=off", "run.steps=2"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, why
    assert len(err) == 1 and err[0].startswith("corun: error:"), err
    assert f"{data}:17" in err[0], why
