"""Every trainer kind against the one hand-written loop (tests/support/loops.py), bitwise, with
the update protocol at full stretch: windows of 2 batches and 2 mini-batches per
update. Each trainer's loss must slice its batch by ``part`` for this to hold; the
plain settings are checked per family in its own test file (and here for the kinds
without one: flow pretraining and the prompt enhancer's warm-up), on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from tests import test_diffusion, test_flow_grpo, test_prompt_enhancer, test_rl_runtime
from tests.support.config import make_config
from tests.support.loops import handwritten_loop, step_records
from tests.support.state import assert_state_equal
from tests.test_unified import PRETRAIN as UNIFIED_PRETRAIN
from tests.test_unified import RL as UNIFIED

pytestmark = pytest.mark.anyio

PE = test_prompt_enhancer.TINY
PE_WARMUP = {k: v for k, v in PE.items() if k.startswith("text_") or k in ("eval_size",)}
KINDS: dict[str, dict[str, Any]] = {
    "sft": {"kind": "sft", "task": "sort", "d_model": 32, "n_heads": 2, "eval_size": 8},
    "grpo": {"kind": "grpo", **test_rl_runtime.TINY},
    "ppo": {"kind": "ppo", **test_rl_runtime.TINY},
    "flow_pretrain": {**test_diffusion.TINY, "grid_size": 0},
    "flow_grpo": test_flow_grpo.TINY,
    "pe_warmup": {"kind": "pe_warmup", **PE_WARMUP, "grid_size": 0},
    "pe": PE,
    "unified_pretrain": UNIFIED_PRETRAIN,
    "unified": UNIFIED,
}


def _config(run_dir: Path, kind: str, **loop: Any) -> corun.Config:
    return make_config(
        run_dir, KINDS[kind], run={"steps": 4, "seed": 2},
        loop={"baseline_eval": False, **loop}, data={"batch_size": 4},
    )  # fmt: skip


async def _assert_run_equals_handwritten(tmp_path: Path, kind: str, **loop: Any) -> None:
    config = _config(tmp_path / "run", kind, **loop)
    trainer_cls = corun.resolve_trainer(config.trainer.kind)
    trainer = trainer_cls(config)
    with anyio.fail_after(120):
        await corun.run(trainer, config)
    reference, records = handwritten_loop(trainer_cls, _config(tmp_path / "ref", kind, **loop))
    assert_state_equal(trainer.state_dict(), reference.state_dict())
    assert step_records(tmp_path / "run") == [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in records
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the protocol is backend-free
@pytest.mark.parametrize("kind", list(KINDS))
async def test_windows_and_mini_batches(tmp_path: Path, anyio_backend: str, kind: str) -> None:
    await _assert_run_equals_handwritten(tmp_path, kind, accumulate=2, mini_batches=2)


@pytest.mark.parametrize("kind", ["flow_pretrain", "pe_warmup"])
async def test_plain(tmp_path: Path, anyio_backend: str, kind: str) -> None:
    await _assert_run_equals_handwritten(tmp_path, kind)
