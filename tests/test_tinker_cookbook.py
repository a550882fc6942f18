"""tinker-cookbook 0.6.1's recipes, unmodified, against a real ``corun serve`` Tinker
process, through examples/tinker_cookbook.py: ``chat_sl`` on corun's word problems
lowers its loss; ``math_rl`` on arithmetic (``importance_sampling``), after a short
``chat_sl`` warm start loaded by ``load_checkpoint_path``, raises its reward. Either
way the server then stops on SIGINT with exit 130 and nothing left listening.

The SL test takes ~20 s, the RL test 75-95 s here (60 warm-start steps,
then 20 RL steps of 64 samples at ~3 s each, the sampling), and its reward rises only
through the format bonus (an answer ending with "\\n\\nUser:" scores 0, else -0.1), a
couple of points a step, so fewer steps would leave the rise within the noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest

from tests.support.processes import REPO, environment
from tests.support.tinker_server import API_KEY, TinkerProcess, tinker_server

pytestmark = pytest.mark.slow
DRIVER = REPO / "examples" / "tinker_cookbook.py"


def run_driver(server: TinkerProcess, logs: Path, *options: str, timeout: float) -> str:
    """The example on ``server``, to completion; its stdout."""
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--base-url", server.url, "--log-dir", str(logs),
         *options],
        cwd=logs.parent, env={**environment(), "TINKER_API_KEY": API_KEY},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:] + server.stderr()[-2000:]
    return done.stdout


def logged(metrics: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [float(row[key]) for row in rows if key in row]


def stopped(server: TinkerProcess) -> None:
    assert server.stop() == 130, server.stderr()[-2000:]
    assert not server.listening()
    assert "Traceback" not in server.stderr()


def test_chat_sl_on_word_problems_lowers_the_loss(tmp_path: Path) -> None:
    with tinker_server(tmp_path) as server:
        out = run_driver(server, tmp_path / "logs", "--task", "sl", "--steps", "12",
                         timeout=180)  # fmt: skip
        losses = logged(tmp_path / "logs" / "sl" / "metrics.jsonl", "train_mean_nll")
        assert len(losses) == 12
        assert losses[-1] < losses[0] - 1.0, losses  # ~5.9 → ~3.9
        assert "sl: train_mean_nll first" in out
        stopped(server)


def test_math_rl_after_a_chat_sl_warm_start_raises_the_reward(tmp_path: Path) -> None:
    with tinker_server(tmp_path) as server:
        out = run_driver(server, tmp_path / "logs", "--task", "rl", "--steps", "20",
                         timeout=600)  # fmt: skip
        warm = logged(tmp_path / "logs" / "warm" / "metrics.jsonl", "train_mean_nll")
        rewards = logged(tmp_path / "logs" / "rl" / "metrics.jsonl", "env/all/reward/total")
        assert warm[-1] < warm[0] - 2.0, warm
        assert len(rewards) == 20
        # Seen here: -0.09 → -0.06 .. -0.03 (the mean of 5 steps); 0.01 is 10 points
        # more answers ending on the stop sequence.
        assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.01, rewards
        assert "rl: env/all/reward/total first" in out
        stopped(server)
