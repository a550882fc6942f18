"""The progress line: headline metrics in a fixed order, and for a multi-track trainer
every track's loss and reward (train/text/loss beside train/image/loss)."""

from __future__ import annotations

import pytest

from corun.records.reporting import Progress


def test_plain_progress_shows_headline_metrics_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("plain", total=2, start=0)
    progress.update(1, {"perf/train_time_s": 0.1, "rollout/reward_mean": 0.5, "train/loss": 2.0})
    progress.update(2, {"eval/reward": 0.75})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step 1/2  train/loss=2  rollout/reward_mean=0.5"
    assert lines[1] == "eval at step 2/2  eval/reward=0.75"


def test_every_track_is_on_the_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("plain", total=1, start=0)
    progress.update(1, {
        "train/text/loss": 1.5, "train/image/loss": 0.25, "rollout/text/reward_mean": 0.5,
        "rollout/image/reward_mean": 0.625, "train/text/grad_norm": 3.0,
    })  # fmt: skip
    assert capsys.readouterr().err.strip() == (
        "step 1/1  train/image/loss=0.25  train/text/loss=1.5  "
        "rollout/image/reward_mean=0.625  rollout/text/reward_mean=0.5"
    )


def test_an_evaluation_is_shown_only_at_its_step_then_marked_carried_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A warm-start run's step-0 evaluation: its own line at step 0; on later lines its
    values are marked with their step, never shown as if just measured."""
    progress = Progress("plain", total=2, start=0)
    progress.update(0, {"eval/accuracy": 0.0, "eval/reward": 0.008})
    progress.update(1, {"train/loss": 2.0})
    progress.update(2, {"train/loss": 1.5, "eval/accuracy": 0.25, "eval/reward": 0.5})
    assert progress.headline(2) == "train/loss=1.5  eval/accuracy=0.25  eval/reward=0.5"
    assert capsys.readouterr().err.splitlines() == [
        "eval at step 0/2  eval/accuracy=0  eval/reward=0.008",
        "step 1/2  train/loss=2  [eval at step 0: eval/accuracy=0  eval/reward=0.008]",
        "eval at step 2/2  eval/accuracy=0.25  eval/reward=0.5",
    ]


def test_the_rich_bar_shows_the_same_headline_as_the_plain_lines() -> None:
    progress = Progress("rich", total=4, start=0)
    progress.start()
    try:
        progress.update(0, {"eval/reward": 0.008})
        progress.update(1, {"train/loss": 2.0})
        shown = progress._bar.tasks[0].fields["headline"]
    finally:
        progress.close()
    assert shown == progress.headline(1) == "train/loss=2  [eval at step 0: eval/reward=0.008]"
