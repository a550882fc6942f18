"""Data parallel for the unified model's kinds (``unified_pretrain``, ``unified``): their
equivalence cases (2 ranks = 1 process through both tracks' losses in one optimizer
step; run by tests/test_distributed_kinds.py) and the settings a rank cannot apply to
its shard alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import corun
from corun.execution.distributed import World
from tests.conftest import make_config
from tests.dp_trainers import TwoShardUnified, TwoShardUnifiedPretrain
from tests.test_distributed import Kinds
from trainers import pg
from trainers.diffusion import flow_rl
from trainers.unified import UnifiedTrainer

# Addition: answers of 1 to 3 digits, so the ranks' shards hold different token counts
# (a text mean over a rank's own count shows) and pad to different lengths.
SHAPE = {
    "task": "addition", "d_model": 32, "n_heads": 2, "n_layers": 1, "sample_steps": 3,
    "grid_size": 0, "text_eval_size": 16, "image_eval_size": 4, "lr": 1e-2,
}  # fmt: skip
# Both tracks weighted unequally, so a track's mean over the wrong count shows.
WEIGHTS = {"text_weight": 0.5, "image_weight": 2.0}
RL = {
    "text": {"samples_per_prompt": 4},
    # The first 2 of 3 steps (the trained steps are the same on every rank); a KL term,
    # the image track's second shared mean.
    "image": {"samples_per_prompt": 4, "timestep_fraction": 0.5, "kl_coef": 0.5},
}
KINDS: Kinds = {
    "unified_pretrain": (
        TwoShardUnifiedPretrain,
        {"kind": "tests.dp_trainers:TwoShardUnifiedPretrain", **SHAPE, **WEIGHTS},
    ),
    "unified": (
        TwoShardUnified,
        {"kind": "tests.dp_trainers:TwoShardUnified", **SHAPE, **WEIGHTS, **RL},
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"text": {"adv_scope": "batch"}}, "text.adv_scope"),
        (
            {"image": {"timestep_fraction": 0.5, "timestep_choice": "random"}},
            "image.timestep_choice",
        ),
        ({"image": {"adv_scope": "batch"}}, "image.adv_scope"),
    ],
)
async def test_whole_batch_settings_are_refused_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str,
    settings: dict[str, Any], refused: str,
) -> None:  # fmt: skip
    """What a rank cannot apply to its shard alone: one line, before any step."""
    for module in (pg, flow_rl):
        monkeypatch.setattr(module, "world", lambda: World(0, 2))
    config = make_config(tmp_path, {"kind": "unified", **SHAPE, **settings})
    with pytest.raises(corun.ConfigError, match=rf"`\$\.trainer\.{refused}`"):
        await corun.run(UnifiedTrainer(config), config)
    assert not os.listdir(tmp_path)  # a refused start leaves its run dir as it was
