"""Data-parallel prompt-enhancer RL (``pe``): the update at world size 2 (a real
``corun train ... run.nproc=2``) equals the one-process update on the same global
batch (tests/dp_trainers.py), both tracks, within test_distributed's tolerances.

Both runs train in float64. In float32 they part on rounding alone, through Adam: a
colour token that no rewrite of the batch chose has an exact-zero gradient in real
arithmetic (the grammar allows it at the colour position only, whose distribution
every rewrite of a group shares, and the group's advantages sum to 0) that float32
computes as noise of 1e-12..1e-9, depending on the order of the sums (two halves or
one batch: the loss summed half by half at world size 1 gives the 2-rank numbers).
AdamW moves that element by lr · g / (|g| + 1e-8), up to 4e-4 at lr 1e-2, and the
changed policy can later sample another rewrite. Measured in float32 beyond the weight
tolerance: 1 of 9 seeds with this config, 2 of 13 with the pe defaults. In float64
the same runs agree to 2e-11, so an error of the data-parallel bookkeeping (a
per-rank statistic, a mean over a shard, a draw) shows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import corun
from corun import SetupContext
from corun.execution.distributed import World
from tests.conftest import make_config
from tests.dp_trainers import TwoShards
from tests.test_distributed import _assert_same, _one_process, _tables, _two_ranks
from tests.test_distributed_kinds import PE
from trainers import pg
from trainers.diffusion import flow_rl
from trainers.pe.rl import PromptEnhancerTrainer


class TwoShardPE(TwoShards, PromptEnhancerTrainer):  # type: ignore[misc]
    """Prompt-enhancer RL in float64 (the default dtype from set-up on: models, noise,
    sampling), with the global batch of tests/dp_trainers.py."""

    def setup(self, ctx: SetupContext) -> None:
        torch.set_default_dtype(torch.float64)
        super().setup(ctx)


PE_RL = {
    "kind": "tests.test_distributed_pe:TwoShardPE", **PE, "lr": 1e-2,
    "grpo": {"samples_per_prompt": 4, "clip_range": 0.2},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the 2-rank run is a subprocess
async def test_two_ranks_equal_one_process(tmp_path: Path, anyio_backend: str) -> None:
    _two_ranks(_tables(PE_RL, tmp_path / "two"), tmp_path / "cfg.toml")
    dtype = torch.get_default_dtype()
    try:
        await _one_process("pe", tmp_path / "one", {"pe": (TwoShardPE, PE_RL)})
    finally:
        torch.set_default_dtype(dtype)
    _assert_same(tmp_path / "two", tmp_path / "one")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("grpo", "refused"),
    [
        ({"adv_scope": "batch"}, "adv_scope"),  # both tracks' advantages
        ({"timestep_fraction": 0.5, "timestep_choice": "random"}, "timestep_choice"),
    ],
)
async def test_whole_batch_settings_are_refused_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str,
    grpo: dict[str, Any], refused: str,
) -> None:  # fmt: skip
    """What a rank cannot apply to its shard alone: one line, before any step."""
    for module in (pg, flow_rl):
        monkeypatch.setattr(module, "world", lambda: World(0, 2))
    config = make_config(tmp_path, {"kind": "pe", **PE, "grpo": grpo})
    with pytest.raises(corun.ConfigError, match=rf"`\$\.trainer\.grpo\.{refused}`"):
        await corun.run(PromptEnhancerTrainer(config), config)
    assert not os.listdir(tmp_path)  # a refused start leaves its run dir as it was
