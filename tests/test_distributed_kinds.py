"""Data-parallel training of the kinds beyond sft and grpo: the update at world size 2
(a real ``corun train ... run.nproc=2``) equals the one-process update on the same
global batch (tests/dp_trainers.py) within test_distributed's tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dp_trainers import (
    TwoShardAgentic,
    TwoShardAgenticPPO,
    TwoShardFlowGRPO,
    TwoShardFlowPretrain,
    TwoShardHFGRPO,
    TwoShardHFPPO,
    TwoShardPEWarmup,
    TwoShardPPO,
)
from tests.test_distributed import (
    SMALL,
    Kinds,
    _assert_same,
    _one_process,
    _tables,
    _two_ranks,
)
from tests.test_distributed_unified import KINDS as UNIFIED
from trainers.agentic.sft import AgenticSFTTrainer
from trainers.hf.sft import HFSFTTrainer
from trainers.hf.tiny import built_in

RL = {"samples_per_prompt": 4, "lr": 1e-2}
TINY_AGENT = {"d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 8}
AGENT = {**TINY_AGENT, **RL}
HF = {"model": "tiny-llama", "eval_size": 4, "max_new_tokens": 6}
HF_RL = {**HF, **RL, "rewards": {"tests.test_hf:letter_share": 1.0}, "truncated_reward": "keep"}
FLOW = {
    "d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 4, "grid_size": 0, "sample_steps": 3,
}  # fmt: skip
FLOW_GRPO = {**FLOW, "lr": 1e-2, "grpo": {"samples_per_prompt": 4, "clip_range": 0.2}}
PE = {**FLOW, "text_d_model": 32, "text_n_layers": 1, "text_n_heads": 2, "text_lr": 1e-2}
KINDS: Kinds = {
    "ppo": (
        TwoShardPPO,
        {"kind": "tests.dp_trainers:TwoShardPPO", **SMALL, **RL, "truncated_reward": "keep"},
    ),
    "agentic_sft": (
        AgenticSFTTrainer,
        {"kind": "agentic_sft", **TINY_AGENT, "demonstrations": 16},
    ),
    "agentic": (TwoShardAgentic, {"kind": "tests.dp_trainers:TwoShardAgentic", **AGENT}),
    "agentic_ppo": (
        TwoShardAgenticPPO,
        {"kind": "tests.dp_trainers:TwoShardAgenticPPO", **AGENT},
    ),
    "hf_sft": (HFSFTTrainer, {"kind": "hf_sft", **HF, "lr": 1e-2}),
    "hf_grpo": (TwoShardHFGRPO, {"kind": "tests.dp_trainers:TwoShardHFGRPO", **HF_RL}),
    "hf_ppo": (TwoShardHFPPO, {"kind": "tests.dp_trainers:TwoShardHFPPO", **HF_RL}),
    "flow_pretrain": (
        TwoShardFlowPretrain,
        {"kind": "tests.dp_trainers:TwoShardFlowPretrain", **FLOW, "lr": 1e-2},
    ),
    "flow_grpo": (TwoShardFlowGRPO, {"kind": "tests.dp_trainers:TwoShardFlowGRPO", **FLOW_GRPO}),
    "pe_warmup": (TwoShardPEWarmup, {"kind": "tests.dp_trainers:TwoShardPEWarmup", **PE}),
    **UNIFIED,
}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the 2-rank run is a subprocess
@pytest.mark.parametrize("kind", list(KINDS))
async def test_two_ranks_equal_one_process(tmp_path: Path, anyio_backend: str, kind: str) -> None:
    cls, trainer = KINDS[kind]
    if "model" in trainer:  # built once, here: not by each rank in the run's directory
        trainer = {**trainer, "model": f"hf:{built_in().resolve()}"}
    _two_ranks(_tables(trainer, tmp_path / "two"), tmp_path / "cfg.toml")
    await _one_process(kind, tmp_path / "one", {kind: (cls, trainer)})
    _assert_same(tmp_path / "two", tmp_path / "one")
