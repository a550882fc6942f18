"""The engine is not the trainer: rollout corrections and mismatch diagnostics through
real hf_grpo runs (the corrections' math against independent re-derivations is
tests/test_pg_corrections.py's).

- an engine whose recorded log-probs are deliberately off (noise added, or top-p
  renormalisation: the probabilities of the kept nucleus, as an engine that reports
  processed log-probs gives them) moves the mismatch metrics past their bound from
  step 1 — an ``alert`` event, a warning on the progress line — and a masking
  correction engages on its tokens; the same run on the honest engine stays quiet;
- an async run with an engine whose log-probs are not the trainer's must choose a
  correction: one line naming the key, exit status 2; a bad correction setting too;
- at concurrency 1, correction "none" (the default) is the hand-written loop, bitwise
  (tests/test_parity.py runs it with the diagnostics on).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.contract.engine import Engine, EngineWrapper, Generation, Sampling
from corun.records.events import read_records
from tests.support.cli import assert_usage_error, call_main
from tests.test_hf import _config
from trainers.hf.rl import HFGRPOTrainer

pytestmark = pytest.mark.anyio


class SkewedEngine(EngineWrapper):
    """Reports log-probs that are not the ones it sampled with."""

    def __init__(self, inner: Engine, how: str) -> None:
        super().__init__(inner)
        self.how = how
        self.generator = torch.Generator().manual_seed(0)

    async def generate(
        self, prompts: Any, sampling: Sampling, seed: int
    ) -> list[Generation]:  # fmt: skip
        return [self._skewed(g) for g in await self.inner.generate(prompts, sampling, seed)]

    def _skewed(self, generation: Generation) -> Generation:
        logprobs = torch.tensor(generation.logprobs)
        if self.how == "noise":
            logprobs += torch.randn(logprobs.shape, generator=self.generator)
        else:  # "top-p": as if renormalised over a nucleus of 30% of the mass
            logprobs = (logprobs - torch.log(torch.tensor(0.3))).clamp(max=0.0)
        return dataclasses.replace(generation, logprobs=logprobs.tolist())


class Skewed(HFGRPOTrainer):
    how = ""

    async def wrap_engine(self, engine: Engine) -> Engine:
        return SkewedEngine(engine, self.how) if self.how else engine


async def _run(tmp_path: Path, how: str, **trainer: Any) -> list[dict[str, Any]]:
    config = _config(tmp_path / how, "hf_grpo", 2, trainer=trainer)
    Skewed.how = how
    with anyio.fail_after(120):
        await corun.run(Skewed(config), config)
    return read_records(tmp_path / how / "metrics.jsonl")


@pytest.mark.parametrize("how", ["noise", "top-p"])
async def test_a_skewed_engine_is_seen_at_step_1_and_corrected(tmp_path: Path, how: str) -> None:
    honest = await _run(tmp_path, "", rollout_correction="token-mis")
    skewed = await _run(tmp_path, how, rollout_correction="token-mis")
    first, quiet = skewed[0], honest[0]
    assert quiet["train/mismatch/k3"] < 1e-4 and quiet["train/alert/mismatch_k3"] == 0
    assert quiet["train/correction/masked"] + quiet["train/correction/rejected"] == 0
    assert first["train/mismatch/k3"] > 0.01 and first["train/alert/mismatch_k3"] > 0.01
    assert first["train/mismatch/share_over"] > 0
    # token-mis drops the tokens whose ratio left its band: the correction engaged.
    assert first["train/correction/rejected"] > 0
    events = read_records(tmp_path / how / "events.jsonl")
    alerts = [e for e in events if e["event"] == "alert"]
    assert alerts and alerts[0]["step"] == 1 and alerts[0]["metric"] == "train/alert/mismatch_k3"


def test_an_async_vllm_run_must_choose_a_correction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["trainer.init_from=", "trainer.engine=vllm", "loop.concurrency=2",
                 f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, _, err = call_main(["train", "hf_grpo", *overrides], capsys)
    assert_usage_error(code, err, "`$.trainer.rollout_correction`")
    assert '"token-tis"' in err and not (tmp_path / "run" / "checkpoints").exists()


def test_a_setting_the_correction_does_not_take_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "hf_grpo", "trainer.rollout_correction=token-tis",
            "trainer.correction_low=0.5", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, _, err = call_main(argv, capsys)
    assert_usage_error(code, err, "`$.trainer.correction_low`")
