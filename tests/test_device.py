"""``run.device`` (corun/execution/device.py): resolved once per run, recorded in the
run's ``start`` event, handed to the trainer as ``SetupContext.device``; a request this
machine cannot meet is refused at start in one line, exit 2, before the run directory
exists. GPUs are simulated where only their count matters (torch.cuda is patched)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import corun
from corun.execution import device
from corun.records.events import read_records
from tests.support.config import make_config
from tests.test_rl_runtime import TINY

REPO = Path(__file__).resolve().parents[1]


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_the_local_rank_gpu_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert device.resolve("auto") == device.resolve("cpu") == torch.device("cpu")
    _gpus(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.resolve("auto") == device.resolve("cuda") == torch.device("cuda", 3)
    assert device.resolve("cuda:1") == torch.device("cuda", 1)
    assert device.resolve("cpu") == torch.device("cpu")  # a GPU left idle on purpose


@pytest.mark.parametrize(
    ("gpus", "setting", "message"),
    [
        (0, "cuda", "`$.run.device` = 'cuda': CUDA is not available here"),
        (0, "cuda:0", "`$.run.device` = 'cuda:0': CUDA is not available here"),
        (2, "cuda:2", "`$.run.device` = 'cuda:2': this machine has 2 GPU(s), cuda:0 to cuda:1"),
    ],
)
def test_a_device_that_is_not_here_is_refused(
    monkeypatch: pytest.MonkeyPatch, gpus: int, setting: str, message: str
) -> None:
    _gpus(monkeypatch, gpus)
    with pytest.raises(corun.ConfigError) as refused:
        device.resolve(setting)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["cuda", "cuda:0"])
def test_corun_train_refuses_cuda_without_one(tmp_path: Path, setting: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal needs one without")
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", "hf_grpo", f"run.device={setting}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"corun: error: `$.run.device` = {setting!r}: CUDA is not available here (torch "
        f'{torch.__version__}, a CPU-only build); use run.device = "cpu" or "auto"'
    ]
    assert list(tmp_path.iterdir()) == []  # no run directory, no warm start trained


def test_a_setting_that_names_no_device_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(corun.ConfigError, match=r"at `\$\.run\.device`"):
        make_config(tmp_path, {"kind": "grpo", **TINY}, run={"device": "gpu"})


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_start_event_and_the_trainer_get_the_device(
    tmp_path: Path, anyio_backend: str
) -> None:
    config = make_config(tmp_path, {"kind": "grpo", **TINY}, run={"steps": 1, "device": "cpu"})
    trainer = corun.resolve_trainer("grpo")(config)
    seen: list[torch.device] = []
    setup = trainer.setup

    def recording(ctx: corun.SetupContext) -> None:
        seen.append(ctx.device)
        setup(ctx)

    trainer.setup = recording  # type: ignore[method-assign]
    with anyio.fail_after(60):
        await corun.run(trainer, config)
    start = next(e for e in read_records(tmp_path / "events.jsonl") if e["event"] == "start")
    assert start["device"] == "cpu" and start["device_name"]
    assert start["device_memory_gib"] > 0
    assert seen == [torch.device("cpu")] and device.current() == torch.device("cpu")
