"""verifiers environments (trainer.task = "verifiers"): the real verifiers 0.4 in an
environment of its own (.venv-verifiers, built once by the fixture from
trainers/hf/verifiers_env/requirements.txt under its constraints; ~50 s to 2 min
from the registry, cached by its stamp), its worker playing a taskset over local
word problems through a live run's episode URLs. Each run is a `corun train`
process, from a scratch folder where the SFT warm start is trained once."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.corun_process import CorunRun
from tests.support.processes import alive, corun_command, environment

REPO = Path(__file__).resolve().parents[1]
WORKER = b"corun_verifiers_worker"
# What docs/agentic.md quotes: held-out greedy numeric match of the warm start, and
# the least the recipe ends at (measured 2026-12-06, shared 2-core CPU VM).
RECIPE_START, RECIPE_MIN_FINAL = 0.2227, 0.255


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder to run from: .venv-verifiers built (or reused) and linked in."""
    builder = importlib.import_module("trainers.hf.verifiers_env.__main__")
    python = builder.build(REPO / ".venv-verifiers")
    folder = tmp_path_factory.mktemp("verifiers")
    (folder / ".venv-verifiers").symlink_to(python.parent.parent)
    return folder


def _corun(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*corun_command(), *args], cwd=cwd, env=environment(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def _train(cwd: Path, name: str, *overrides: str, timeout: float = 600) -> Any:
    config = str(REPO / "configs" / "hf_verifiers.toml")
    args = ["train", config, f"run.dir={cwd / name}", "log.progress=off", *overrides]
    return _corun(args, cwd, timeout)


def _worker_pids(marker: Path) -> list[int]:
    """Live verifiers workers whose command line names ``marker`` (a run's folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if WORKER in cmdline and str(marker).encode() in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_missing_interpreter_fails_the_run_in_one_line(scratch: Path) -> None:
    done = _train(scratch, "bad", "trainer.environment.python=/no/such/python", timeout=300)
    assert done.returncode == 2, done.stderr
    assert "trainer.environment.python" in _last_line(done.stderr), done.stderr
    assert "Traceback" not in done.stderr


def test_an_environment_without_verifiers_fails_the_run_in_one_line(scratch: Path) -> None:
    python = f"trainer.environment.python={REPO / '.venv' / 'bin' / 'python'}"
    done = _train(scratch, "noverifiers", python, "run.steps=2", "loop.baseline_eval=false")
    assert done.returncode == 2, done.stderr
    last = _last_line(done.stderr)
    assert "Traceback" not in done.stderr
    assert "verifiers worker exited 3" in last and "cannot import verifiers" in last, last
    assert not _worker_pids(scratch / "noverifiers")


def test_the_recipe_trains_on_the_rubric_rewards(scratch: Path) -> None:
    """The worker against a live run's endpoint: episodes captured token for token
    (the trainer's recomputed log-probs equal the behaviour ones at the first step),
    rubric rewards arriving, held-out reward up by several standard errors; no
    worker left once the run ends."""
    started = time.monotonic()
    done = _train(scratch, "recipe")
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _metrics(scratch / "recipe")
    steps = [r for r in rows if "rollout/reward_mean" in r]
    evals = [r["eval/reward"] for r in rows if "eval/success" in r]
    assert len(steps) == 100 and any(r["rollout/reward_mean"] > 0 for r in steps)
    assert abs(steps[0]["train/kl"]) < 1e-4  # the trained ids are the sampled ones
    assert evals[0] == pytest.approx(RECIPE_START, abs=0.01)
    assert evals[-1] >= RECIPE_MIN_FINAL, (evals, elapsed)
    assert not _worker_pids(scratch / "recipe")
    print(f"hf_verifiers: {evals} in {elapsed:.0f} s")


def test_ctrl_c_exits_130_and_ends_the_worker(scratch: Path) -> None:
    run_dir = scratch / "interrupted"
    command = [*corun_command(), "train", str(REPO / "configs" / "hf_verifiers.toml"),
               f"run.dir={run_dir}", "run.steps=1000", "loop.baseline_eval=false",
               "log.progress=plain"]  # fmt: skip
    out, err = (scratch / "stdout.txt").open("wb"), (scratch / "stderr.txt").open("wb")
    proc = subprocess.Popen(
        command, cwd=scratch, env=environment(), stdin=subprocess.DEVNULL, stdout=out,
        stderr=err, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    run = CorunRun(proc, scratch, run_dir, _files=[out, err])
    try:
        run.wait_until(
            "a step trained on the worker's episodes", lambda: run.names().count("step") >= 2, 300
        )
        assert _worker_pids(run_dir)
        run.send(signal.SIGINT)
        assert run.wait_exit() == 130, run.stderr()
        names = run.names()  # the worker ends in the trainer's teardown, before the engine
        assert names.index("teardown:verifiers_worker") < names.index("teardown:engine")
        assert names[-1] == "end"
        assert not _worker_pids(run_dir)
    finally:
        _end(proc, out, err)


def test_a_worker_that_dies_mid_run_fails_the_run_in_one_line(scratch: Path) -> None:
    """Nothing else submits the episodes: a worker killed mid-run ends the run (exit 1,
    the worker named) instead of leaving it waiting on its inbox."""
    run_dir = scratch / "worker-died"
    command = [*corun_command(), "train", str(REPO / "configs" / "hf_verifiers.toml"),
               f"run.dir={run_dir}", "run.steps=1000", "loop.baseline_eval=false",
               "log.progress=off"]  # fmt: skip
    logs = scratch / "worker-died-logs"
    logs.mkdir()
    out, err = (logs / "stdout.txt").open("wb"), (logs / "stderr.txt").open("wb")
    proc = subprocess.Popen(
        command, cwd=scratch, env=environment(), stdin=subprocess.DEVNULL, stdout=out,
        stderr=err,
    )  # fmt: skip
    run = CorunRun(proc, logs, run_dir, _files=[out, err])
    try:
        run.wait_until(
            "a step trained on the worker's episodes", lambda: run.names().count("step") >= 1, 300
        )
        for pid in _worker_pids(run_dir):
            os.kill(pid, signal.SIGKILL)
        assert run.wait_exit() == 1, run.stderr()
        assert "the verifiers worker exited -9 mid-run" in _last_line(run.stderr())
        assert run.names()[-1] == "end"
    finally:
        _end(proc, out, err)


def _end(proc: subprocess.Popen[bytes], *files: IO[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in files:
        f.close()
