"""The trainer docs/writing-a-trainer.md opens with (examples/loo_trainer.py, a
leave-one-out policy gradient) runs through `corun train` by its dotted name and learns:
the held-out reward after 200 steps (of examples/loo.toml's 400) is well above the
baseline evaluation's at step 0 (it dips for the first ~25 steps, then climbs). The
whole config's figure, which docs/writing-a-trainer.md quotes, is a check of
benchmarks/recipes.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corun.records.events import read_records

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200


@pytest.mark.slow  # 200 steps of 16 prompts x 8 answers: ~2-3 minutes
def test_loo_example_learns(tmp_path: Path) -> None:
    # From tmp_path: the warm start (the shipped sft_warmup.toml) trains into runs/ there.
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(ROOT / "examples" / "loo.toml"),
         f"run.dir={tmp_path / 'run'}", f"run.steps={STEPS}", f"loop.eval_interval={STEPS}",
         "loop.save_interval=0", "trainer.eval_size=256", "log.progress=off"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    evals = {r["step"]: r for r in records if "eval/reward" in r}
    assert sorted(evals) == [0, STEPS]
    before, after = evals[0], evals[STEPS]
    assert after["eval/reward"] > before["eval/reward"] + 0.05, (before, after)
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert {"rollout/reward_mean", "rollout/exact_match", "train/answer_logp"} <= steps[-1].keys()


def test_the_doc_shows_the_example() -> None:
    doc = (ROOT / "docs" / "writing-a-trainer.md").read_text()
    assert (ROOT / "examples" / "loo_trainer.py").read_text() in doc
    assert (ROOT / "examples" / "loo.toml").read_text() in doc
