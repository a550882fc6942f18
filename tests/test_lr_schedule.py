"""The learning-rate schedule (``loop.lr_schedule``, corun/loop/schedule.py): the factor
curve, the rate each update steps with (``train/lr``), a resumed run continuing the
same curve, and a trainer that steps its own optimizers refused one."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.base.errors import ConfigError
from corun.loop.schedule import lr_factor
from tests.support.config import make_config
from tests.support.fakes import FakeError, FakeTrainer
from tests.support.loops import step_records
from tests.support.state import assert_state_equal

pytestmark = pytest.mark.anyio

BASE_LR = 0.05  # FakeTrainer's Adam


def test_factor_curves() -> None:
    assert [lr_factor("constant", u, 10) for u in range(10)] == [1.0] * 10
    cosine = [lr_factor("cosine", u, 10, warmup=2, final=0.1) for u in range(10)]
    assert cosine[:3] == [1 / 3, 2 / 3, 1.0]  # warm-up, then the full rate
    assert cosine[-1] == pytest.approx(0.1)  # the last update gets exactly `final`
    assert all(a > b for a, b in itertools.pairwise(cosine[2:]))
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))
    linear = [lr_factor("linear", u, 5) for u in range(5)]
    assert linear == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert lr_factor("linear", 7, 5) == 0.0  # past the horizon: stays at `final`


def _trainer(run_dir: Path, fake: dict[str, Any] | None = None) -> FakeTrainer:
    config = make_config(
        run_dir, {"kind": "tests.support.fakes:FakeTrainer", **(fake or {})},
        run={"steps": 8},
        loop={"accumulate": 2, "save_interval": 2, "baseline_eval": False,
              "lr_schedule": "cosine", "lr_warmup": 1, "lr_final": 0.2},
    )  # fmt: skip
    return FakeTrainer(config)


async def test_each_update_steps_at_its_scheduled_rate(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run")
    with anyio.fail_after(60):
        await corun.run(trainer, trainer.run_config)
    rates = [r["train/lr"] for r in step_records(tmp_path / "run") if "train/lr" in r]
    # Four updates (8 steps, windows of 2), reported at each window's end.
    expected = [BASE_LR * lr_factor("cosine", v, 4, warmup=1, final=0.2) for v in range(4)]
    assert rates == pytest.approx(expected)
    assert rates[-1] == pytest.approx(BASE_LR * 0.2)
    group = trainer.optimizer.param_groups[0]
    assert group["base_lr"] == BASE_LR  # the trainer's own rate is kept as the base


async def test_a_resumed_run_continues_the_curve(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "straight")
    with anyio.fail_after(120):
        await corun.run(straight, straight.run_config)
        failing = _trainer(tmp_path / "split", {"fail_in": "train", "fail_at_step": 5})
        with pytest.raises(FakeError):
            await corun.run(failing, failing.run_config)
        resumed = _trainer(tmp_path / "split")
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())
    straight_rates = [r.get("train/lr") for r in step_records(tmp_path / "straight")]
    assert [r.get("train/lr") for r in step_records(tmp_path / "split")][-4:] == (
        straight_rates[-4:]
    )


def _extended(run_dir: Path, steps: int, **loop: Any) -> FakeTrainer:
    config = make_config(
        run_dir, {"kind": "tests.support.fakes:FakeTrainer"}, run={"steps": steps},
        log={"progress": "plain"},
        loop={"accumulate": 2, "save_interval": 2, "baseline_eval": False,
              "lr_schedule": "cosine", **loop},
    )  # fmt: skip
    return FakeTrainer(config)


async def test_extending_a_run_says_the_horizon_moved_and_lr_horizon_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished 4-step run (2 updates) resumed with run.steps = 8: one line at the
    start names both horizons and the rate at the resumed update under each; the
    rates then follow the 4-update curve. With loop.lr_horizon = 4 the first curve is
    kept (the rate stays at its end, 0) and nothing is said."""
    with anyio.fail_after(120):
        for run in ("moved", "kept"):
            first = _extended(tmp_path / run, 4)
            await corun.run(first, first.run_config)
        capsys.readouterr()
        moved = _extended(tmp_path / "moved", 8)
        await corun.run(moved, moved.run_config)
        said = [line for line in capsys.readouterr().err.splitlines() if "schedule" in line]
        kept = _extended(tmp_path / "kept", 8, lr_horizon=4)
        await corun.run(kept, kept.run_config)
        assert not [line for line in capsys.readouterr().err.splitlines() if "schedule" in line]
    now = lr_factor("cosine", 2, 4)
    assert said == [
        "corun: the cosine learning-rate schedule now spans 4 updates, not the 2 it was "
        f"saved under (run.steps or loop.accumulate changed): at update 2 the rate is "
        f"{now:.3g} of its base where the first curve had 0; loop.lr_horizon = 4 keeps the "
        "first curve"
    ]
    rates = [r["train/lr"] for r in step_records(tmp_path / "moved") if "train/lr" in r]
    assert rates[2:] == pytest.approx([BASE_LR * lr_factor("cosine", v, 4) for v in (2, 3)])
    kept_rates = [r["train/lr"] for r in step_records(tmp_path / "kept") if "train/lr" in r]
    assert kept_rates[2:] == [0.0, 0.0]


class OwnStepTrainer(FakeTrainer):
    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        return {}


async def test_a_trainer_with_its_own_step_is_refused_a_schedule(tmp_path: Path) -> None:
    config = make_config(
        tmp_path / "run", {"kind": "tests.test_lr_schedule:OwnStepTrainer"},
        loop={"lr_schedule": "linear"},
    )  # fmt: skip
    with anyio.fail_after(60), pytest.raises(ConfigError, match=r"loop\.lr_schedule"):
        await corun.run(OwnStepTrainer(config), config)
    assert not (tmp_path / "run" / "checkpoints").exists()
