"""LoRA and precision through whole runs of the hf kinds (one process; the sharded
runs are tests/test_fsdp.py's, the adapter engines' own checks
tests/test_engine_adapters.py's):

- a LoRA GRPO run trains the adapters only: every base weight is bitwise the loaded
  one after the run, the adapters moved, and the checkpoint holds only the adapters;
- resumed half-way it equals the straight run bitwise;
- the engine samples with the synced adapter: the log-probs it reports for its tokens
  equal the trainer's for the same tokens within 1e-4 (the transformers engine here;
  vLLM in process, slow, below);
- an export of a LoRA checkpoint is the merged model;
- SFT in bfloat16 and float16 learns (held-out loss falls as in float32's run).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.contract.engine import Sampling
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.state import assert_state_equal
from tests.test_hf import _config, _run
from trainers.hf.policy import load_policy
from trainers.hf.rl import HFGRPOTrainer, to_rollouts
from trainers.hf.state import export
from trainers.lm.policy import rollout_logprobs

pytestmark = pytest.mark.anyio

LORA = {"lora": {"rank": 4, "alpha": 8.0, "lr_scale": 1.0, "b_lr_ratio": 1.0}, "lr": 1e-2}


def _lora_config(run_dir: Path, steps: int = 4, resume: bool = False, **trainer: Any) -> Any:
    loop = {"save_interval": 2, "eval_interval": 2}
    return _config(run_dir, "hf_grpo", steps, trainer={**LORA, **trainer}, loop=loop,
                   checkpoint={"resume": resume})  # fmt: skip


async def test_lora_trains_only_the_adapters_and_resumes_exactly(tmp_path: Path) -> None:
    trainer: Any = await _run(_lora_config(tmp_path / "straight"))
    base, _ = load_policy("tiny-llama", "base")
    trained = dict(trainer.policy.model.named_parameters())
    for name, weight in base.model.named_parameters():
        adapted = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(trained.get(adapted, trained.get(name)), weight), name
    adapters = {n: p for n, p in trained.items() if "lora_" in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # moved
    _, tensors = checkpoint.read(checkpoint.step_dir(tmp_path / "straight", 4))
    assert {n.rsplit(".", 2)[-2] for n in tensors["trainer"]["model"]} == {"lora_A", "lora_B"}

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(checkpoint.step_dir(resumed, 4))
    await _run(_lora_config(resumed, resume=True))
    assert_state_equal(
        checkpoint.read(checkpoint.step_dir(resumed, 4))[1]["trainer"],
        tensors["trainer"],
    )


class EngineChecked(HFGRPOTrainer):
    """At its evaluation (after the last step's sync), samples from its engine and
    recomputes the same tokens' log-probs with the trained policy."""

    async def evaluate(self) -> dict[str, float]:
        prompts = [self.chat.encode(e.prompt) for e in self.eval_examples[:4]]
        sampling = Sampling(6, 1.0, 1.0, (self.chat.eos_id,))
        rollouts = to_rollouts(
            prompts, await self.engine.generate(prompts, sampling, 7), self.chat.pad_id
        )
        with torch.no_grad():
            mine, _, _ = rollout_logprobs(self.policy, rollouts, 1.0)
        mask = rollouts.response_mask
        self.gap = float((mine[mask] - rollouts.logprobs[mask]).abs().max())
        return {}


async def _engine_gap(run_dir: Path, **trainer: Any) -> float:
    config = _lora_config(run_dir, steps=2, **trainer)
    checked = EngineChecked(config)
    with anyio.fail_after(180):
        await corun.run(checked, config)
    return checked.gap


async def test_the_engine_samples_with_the_synced_adapter(tmp_path: Path) -> None:
    assert await _engine_gap(tmp_path / "run") < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_vllm_samples_with_the_synced_adapter(tmp_path: Path, anyio_backend: str) -> None:
    pytest.importorskip("vllm")
    assert await _engine_gap(tmp_path / "run", engine="vllm") < 1e-4


async def test_a_lora_checkpoint_exports_the_merged_model(tmp_path: Path) -> None:
    trainer: Any = await _run(_lora_config(tmp_path / "run", steps=2))
    out = export(str(tmp_path / "run"), tmp_path / "export")
    exported, _ = load_policy(f"hf:{out}", "export")
    ids = torch.tensor([[5, 9, 17, 33, 60]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids), trainer.policy(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_low_precision_sft_learns(tmp_path: Path, dtype: str) -> None:
    trainer = {"dtype": dtype, "lr": 3e-3, "eval_size": 32}
    config = _config(tmp_path / "run", "hf_sft", 20, trainer=trainer,
                     loop={"baseline_eval": True, "eval_interval": 20},
                     data={"batch_size": 16})  # fmt: skip
    await _run(config)
    evals = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "eval/loss" in r]
    first, last = evals[0]["eval/loss"], evals[-1]["eval/loss"]
    assert last < 0.6 * first, (first, last)
