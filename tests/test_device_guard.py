"""Every trainer kind is device-clean: a few steps of each, from a fresh run directory,
under tests/support/device_guard.py's guard, which records each tensor corun's or a
trainer's own code makes without naming a device, and each move to the CPU. On this
CPU-only machine such a tensor computes; on a GPU it would meet the model's tensors.
Every site seen must be on the allow-list below, with why it is meant: data and
rewards built on the CPU and moved once, seeded draws on a CPU generator (the same
samples on any device), results to the CPU for rewards and records. The models and
batches themselves go to ``SetupContext.device`` (tests/test_device.py checks that the
trainer gets it); the kinds' own tests check the CPU results are unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from tests import test_distributed as td
from tests.support.config import make_config
from tests.support.device_guard import Site, guarding
from tests.test_hf_agentic import RL as HF_AGENTIC_RL
from tests.test_hf_agentic import SFT as HF_AGENTIC_SFT

KINDS: dict[str, dict[str, Any]] = {
    "sft": {"kind": "sft", **td.SMALL},
    "grpo": {"kind": "grpo", **td.SMALL, **td.RL},
    "ppo": {"kind": "ppo", **td.SMALL, **td.RL},
    "agentic_sft": {"kind": "agentic_sft", **td.TINY_AGENT, "demonstrations": 16},
    "agentic": {"kind": "agentic", **td.AGENT},
    "agentic_ppo": {"kind": "agentic_ppo", **td.AGENT},
    "hf_sft": {"kind": "hf_sft", **td.HF, "lr": 1e-2},
    "hf_grpo": {"kind": "hf_grpo", **td.HF_RL},
    "hf_ppo": {"kind": "hf_ppo", **td.HF_RL},
    "hf_agentic_sft": HF_AGENTIC_SFT,
    "hf_agentic": {"kind": "hf_agentic", **HF_AGENTIC_RL},
    "flow_pretrain": {"kind": "flow_pretrain", **td.FLOW, "lr": 1e-2},
    "flow_grpo": {"kind": "flow_grpo", **td.FLOW_GRPO},
    "pe_warmup": {"kind": "pe_warmup", **td.PE},
    "pe": {"kind": "pe", **td.PE_RL},
    "unified_pretrain": {"kind": "unified_pretrain", **td.SHAPE, **td.WEIGHTS},
    "unified": {"kind": "unified", **td.SHAPE, **td.WEIGHTS, **td.UNIFIED_RL},
}

ALLOWED: dict[Site, str] = {  # (path, function, what): why it is meant
    (
        "corun/agents/runner.py",
        "run_episodes",
        "torch.tensor without device",
    ): "a turn's transcripts built from lists on the CPU; the engine moves them once per turn",
    (
        "corun/engines/decode.py",
        "left_pad",
        "torch.tensor without device",
    ): "rollout batches built on the CPU and moved once; generate passes the model's device",
    (
        "corun/records/checkpoint.py",
        "snapshot",
        "Tensor.to(cpu)",
    ): "checkpoints are written from a CPU snapshot, by design",
    (
        "trainers/agentic/rl.py",
        "episode_rollouts",
        "torch.tensor without device",
    ): "episodes (Python lists) as a CPU batch; the finished Scored moves once",
    (
        "trainers/agentic/rl.py",
        "rollout",
        "torch.tensor without device",
    ): "episode rewards and flags on the CPU; moved once with the Scored batch",
    (
        "trainers/agentic/rl.py",
        "rows",
        "torch.tensor without device",
    ): "episode_rollouts' rows: a CPU-built batch, moved once as a whole",
    (
        "trainers/agentic/sft.py",
        "encode_demonstrations",
        "torch.tensor without device",
    ): "data: demonstration tokens built on the CPU; prepare moves them once",
    (
        "trainers/diffusion/evaluation.py",
        "__init__",
        "torch.rand without device",
    ): "held-out times from the CPU generator (the same eval inputs on any device), moved once",
    (
        "trainers/diffusion/evaluation.py",
        "__init__",
        "torch.randn without device",
    ): "held-out noise from the CPU generator (the same eval inputs on any device), moved once",
    (
        "trainers/diffusion/evaluation.py",
        "samples",
        "Tensor.cpu()",
    ): "eval images to the CPU once: rewards and the PNG grid are the CPU's",
    (
        "trainers/diffusion/flow_rl.py",
        "sample_groups",
        "Tensor.cpu()",
    ): "rollout images to the CPU once per step: image rewards are the CPU's",
    (
        "trainers/diffusion/flow_rl.py",
        "sample_groups",
        "torch.randperm without device",
    ): "trained denoising steps from the CPU generator: a list of ints",
    (
        "trainers/diffusion/model.py",
        "__init__",
        "torch.randn without device",
    ): "parameter init from the seeded RNG before the model moves to the device",
    (
        "trainers/diffusion/pretrain.py",
        "flow_batch",
        "torch.rand without device",
    ): "flow-matching times from the CPU generator; prepare moves the batch",
    (
        "trainers/diffusion/pretrain.py",
        "flow_batch",
        "torch.randn without device",
    ): "flow-matching noise from the CPU generator; prepare moves the batch",
    (
        "trainers/diffusion/sampling.py",
        "cpu_noise",
        "torch.randn without device",
    ): "sampling noise from the CPU generator (the same samples on any device), then moved",
    (
        "trainers/diffusion/shapes.py",
        "encode",
        "torch.tensor without device",
    ): "data: prompt tokens built on the CPU",
    (
        "trainers/diffusion/shapes.py",
        "render",
        "torch.arange without device",
    ): "data: target images rendered on the CPU",
    (
        "trainers/diffusion/shapes.py",
        "render",
        "torch.tensor without device",
    ): "data: target images rendered on the CPU",
    (
        "trainers/diffusion/shapes.py",
        "sample_prompts",
        "torch.randint without device",
    ): "data: prompts drawn from the data's CPU generator",
    (
        "trainers/diffusion/shapes.py",
        "score",
        "torch.arange without device",
    ): "rewards: images scored on the CPU",
    (
        "trainers/diffusion/shapes.py",
        "uniform",
        "torch.rand without device",
    ): "data: render jitter from the data's CPU generator",
    (
        "trainers/hf/agentic.py",
        "rollout",
        "torch.tensor without device",
    ): "episode rewards and flags from the environments on the CPU; moved once with Scored",
    (
        "trainers/hf/agentic_sft.py",
        "episode_tokens",
        "torch.tensor without device",
    ): "data: token ids built from text on the CPU; SFTTrainer.prepare moves them once",
    (
        "trainers/hf/evaluation.py",
        "evaluate",
        "torch.tensor without device",
    ): "eval rewards from decoded text, reduced to metrics on the CPU",
    (
        "trainers/hf/rl.py",
        "rollout",
        "torch.randint without device",
    ): "the engine seed drawn from the CPU rollout generator: reproducible on any device",
    (
        "trainers/hf/rl.py",
        "rollout",
        "torch.tensor without device",
    ): "rewards from decoded text on the CPU; Scored moves once",
    (
        "trainers/hf/rl.py",
        "rows",
        "torch.tensor without device",
    ): "rollouts built from generation lists on the CPU; moved once with Scored",
    (
        "trainers/hf/rl.py",
        "to_rollouts",
        "torch.tensor without device",
    ): "truncation flags from generation lists on the CPU; moved once with Scored",
    (
        "trainers/lm/rl.py",
        "task_rewards",
        "torch.tensor without device",
    ): "rewards scored from decoded text on the CPU; sample_and_score moves them once",
    (
        "trainers/lm/tasks.py",
        "encode_prompts",
        "torch.tensor without device",
    ): "data: prompt ids built from text on the CPU; the engine moves them once",
    (
        "trainers/lm/tasks.py",
        "teacher_forcing",
        "torch.tensor without device",
    ): "data: the SFT token batch built on the CPU; SFTTrainer.prepare moves it once",
    (
        "trainers/pe/prompts.py",
        "_pick",
        "torch.randint without device",
    ): "data: user phrasing from the data's CPU generator",
    (
        "trainers/pe/prompts.py",
        "encode_user",
        "torch.tensor without device",
    ): "data: user prompts encoded on the CPU, moved once",
    (
        "trainers/pe/prompts.py",
        "phrase",
        "torch.randint without device",
    ): "data: user phrasing from the data's CPU generator",
    (
        "trainers/unified/model.py",
        "__init__",
        "torch.empty without device",
    ): "parameter allocation before the model moves to the device",
}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_kind_keeps_its_tensors_on_the_run_device(
    tmp_path: Path, anyio_backend: str, kind: str
) -> None:
    config = make_config(
        tmp_path / "run", KINDS[kind], run={"steps": 2, "seed": 1},
        loop={"eval_interval": 2, "save_interval": 2}, data={"batch_size": 4},
    )  # fmt: skip
    trainer = corun.resolve_trainer(config.trainer.kind)(config)
    with guarding() as guard, anyio.fail_after(180):
        await corun.run(trainer, config)
    unexplained = sorted(guard.sites - ALLOWED.keys())
    assert unexplained == [], f"{kind}: tensors made or moved off the run's device: {unexplained}"
