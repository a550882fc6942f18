"""The unified model (text head + flow head on one backbone) through the template:
parity of both trainer kinds with a hand-written loop (bitwise, asyncio and trio),
resume parity, the golden event order of a clean exit, both tracks' losses in one
optimizer step, multi-track metric names, bad input, and a short learning test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import TEARDOWN_ORDER
from tests.support.loops import RecordsHooks, handwritten_loop, lifecycle, step_records
from tests.support.state import assert_state_equal
from trainers.unified import UnifiedPretrainTrainer, UnifiedTrainer
from trainers.unified.base import UnifiedBase

pytestmark = pytest.mark.anyio
# The runtime's teardown steps; the in-process engine registers none of its own.
TEARDOWN = [s for s in TEARDOWN_ORDER if s not in ("teardown:weight_sync", "teardown:engine")]

SHAPE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "sample_steps": 4, "grid_size": 4}
EVAL = {"text_eval_size": 16, "image_eval_size": 8}
PRETRAIN = {"kind": "unified_pretrain", **SHAPE, **EVAL}
RL = {
    "kind": "unified", **SHAPE, **EVAL, "lr": 1e-3,
    "text": {"samples_per_prompt": 4}, "image": {"samples_per_prompt": 4, "timestep_fraction": 0.5},
}  # fmt: skip
KINDS: dict[str, tuple[type[UnifiedBase[Any]], dict[str, Any]]] = {
    "pretrain": (UnifiedPretrainTrainer, PRETRAIN),
    "rl": (UnifiedTrainer, RL),
}


def _config(
    run_dir: Path, kind: str, steps: int, trainer: dict[str, Any] | None = None, **loop: Any
) -> corun.Config:
    return make_config(
        run_dir, {**KINDS[kind][1], **(trainer or {})}, run={"steps": steps, "seed": 5},
        loop={"baseline_eval": False, **loop}, data={"batch_size": 2},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "accumulate", "variant"),
    [
        ("pretrain", 1, {"text_weight": 0.5}),
        ("rl", 1, {}),
        ("rl", 2, {"image": RL["image"] | {"kl_coef": 0.5}, "text_weight": 2.0}),
    ],
    ids=["pretrain", "rl", "rl-window2-kl-weights"],
)
async def test_run_equals_handwritten_loop(
    tmp_path: Path, anyio_backend: str, kind: str, accumulate: int, variant: dict[str, Any]
) -> None:
    config = _config(tmp_path / "run", kind, 4, variant, accumulate=accumulate)
    trainer = KINDS[kind][0](config)
    with anyio.fail_after(60):
        await corun.run(trainer, config)
    reference, records = handwritten_loop(
        KINDS[kind][0], _config(tmp_path / "ref", kind, 4, variant, accumulate=accumulate)
    )
    assert_state_equal(trainer.state_dict(), reference.state_dict())
    assert step_records(tmp_path / "run") == [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in records
    ]
    if kind == "rl":  # the rollout copy got the same weights, at the same version
        assert_state_equal(trainer.engine.model.state_dict(), reference.engine.model.state_dict())
        assert trainer.engine.version == reference.engine.version == 4 // accumulate
        assert any(r["rollout/text/reward_std"] > 0 for r in records)
        assert any(r["rollout/image/reward_std"] > 0 for r in records)
        assert [("train/grad_norm" in r) for r in records] == [
            (i + 1) % accumulate == 0 for i in range(4)
        ]
    if variant.get("image", {}).get("kl_coef"):
        assert records[-1]["train/image/kl"] > 0


async def test_resume_equals_straight(tmp_path: Path) -> None:
    loop = {"accumulate": 2, "save_interval": 2}
    with anyio.fail_after(60):
        straight = UnifiedTrainer(_config(tmp_path / "straight", "rl", 4, **loop))
        await corun.run(straight, straight.run_config)
        first = UnifiedTrainer(_config(tmp_path / "split", "rl", 2, **loop))
        await corun.run(first, first.run_config)
        resumed = UnifiedTrainer(_config(tmp_path / "split", "rl", 4, **loop))
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())
    assert_state_equal(straight.engine.model.state_dict(), resumed.engine.model.state_dict())
    assert step_records(tmp_path / "straight") == step_records(tmp_path / "split")


async def test_async_rollout_workers(tmp_path: Path) -> None:
    """Rollouts on two worker threads sample from replicas of the whole model."""
    config = _config(tmp_path, "rl", 4, concurrency=2, workers=2, order="completion")
    trainer = UnifiedTrainer(config)
    with anyio.fail_after(60):
        outcome = await corun.run(trainer, config)
    assert outcome.reason == "done" and len(trainer.replicas) == 2
    steps = [r for r in read_records(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 4 and all(r["async/staleness_max"] <= 1 for r in steps)


class Recording(RecordsHooks, UnifiedTrainer):
    """Records its hook calls, and each optimizer step with the gradient norms of the
    text head's and the flow head's own parameters at that moment."""

    def setup(self, ctx: corun.SetupContext) -> None:
        super().setup(ctx)
        self.steps: list[dict[str, float]] = []
        step, params = self.optimizer.step, self.model.track_parameters()

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self.steps.append({
                track: float(sum(p.grad.norm() for p in ps if p.grad is not None))
                for track, ps in params.items()
            })  # fmt: skip
            return step(*args, **kwargs)

        self.optimizer.step = counted_step  # type: ignore[method-assign]


async def test_clean_exit_golden_event_order_and_one_step_per_window(tmp_path: Path) -> None:
    config = make_config(
        tmp_path, RL, run={"steps": 4}, data={"batch_size": 2},
        loop={"accumulate": 2, "eval_interval": 2, "save_interval": 4},
    )  # fmt: skip
    trainer = Recording(config)
    with anyio.fail_after(60):
        outcome = await corun.run(trainer, config)
    assert outcome.reason == "done" and outcome.step == 4
    assert trainer.calls == [
        "setup", "eval:0",
        "rollout:0", "train:0", "rollout:1", "train:1", "sync:1", "eval:2",
        "rollout:2", "train:2", "rollout:3", "train:3", "sync:2", "eval:4", "state_dict",
        "on_train_end:done",
    ]  # fmt: skip
    events = lifecycle(tmp_path)
    assert events == [
        "start", "setup", "baseline_eval",
        "step", "step", "sync", "eval",
        "step", "step", "sync", "eval", "save",
        *TEARDOWN, "end",
    ]  # fmt: skip
    # One optimizer step per window, and in it both heads' (and the backbone's) gradients.
    assert len(trainer.steps) == 2
    assert all(norms[track] > 0 for norms in trainer.steps for track in norms), trainer.steps


async def test_metrics_are_per_track(tmp_path: Path) -> None:
    config = make_config(
        tmp_path, RL, run={"steps": 2}, data={"batch_size": 2}, loop={"eval_interval": 2}
    )
    with anyio.fail_after(60):
        await corun.run(UnifiedTrainer(config), config)
    records = read_records(tmp_path / "metrics.jsonl")
    keys = {key for record in records for key in record}
    for track in ("text", "image"):
        assert {f"train/{track}/loss", f"rollout/{track}/reward_mean"} <= keys
        assert {f"rollout/{track}/reward_std", f"train/{track}/clip_ratio"} <= keys
    assert {"eval/text/accuracy", "eval/text/reward", "eval/image/reward"} <= keys
    grids = [Path(r["eval/samples"]) for r in records if "eval/samples" in r]
    assert [g.name for g in grids] == ["step-0.png", "step-2.png"]
    assert all(g.read_bytes().startswith(b"\x89PNG") for g in grids)


async def test_other_checkpoints_are_refused(tmp_path: Path) -> None:
    small = {"d_model": 32, "n_heads": 2, "n_layers": 1}
    for name, trainer in [("sft", {"kind": "sft", **small}), ("flow", {"kind": "flow_pretrain"})]:
        config = make_config(
            tmp_path / name, {**trainer, **small}, run={"steps": 1},
            loop={"baseline_eval": False}, data={"batch_size": 2},
        )  # fmt: skip
        await corun.run(corun.resolve_trainer(trainer["kind"])(config), config)
        checkpoint = str(tmp_path / name / "checkpoints" / "step-1")
        rl = _config(tmp_path / f"rl-{name}", "rl", 1, {"init_from": checkpoint})
        with pytest.raises(corun.CheckpointError, match="not a unified model checkpoint"):
            await corun.run(UnifiedTrainer(rl), rl)
    # Resuming into a run directory that holds another kind's checkpoint is refused too.
    resumed = _config(tmp_path / "flow", "rl", 2)
    with pytest.raises(corun.CheckpointError, match="trainer kind 'flow_pretrain', not 'unified'"):
        await corun.run(UnifiedTrainer(resumed), resumed)


def test_bad_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(corun.ConfigError, match="samples_per_prompt"):
        _config(tmp_path, "rl", 2, {"text": {"samples_per_prompt": 1}})
    with pytest.raises(corun.ConfigError, match="d_model"):
        _config(tmp_path, "pretrain", 2, {"d_model": 30, "n_heads": 4})
    with pytest.raises(corun.ConfigError, match="accumulate"):
        _config(tmp_path, "pretrain", 3, accumulate=2)  # run.steps not a whole window


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the same on trio: parity above
async def test_learning_raises_the_text_eval_reward(tmp_path: Path) -> None:
    """80 pretraining steps (a prerequisite config, trained first), then 60 RL steps on
    both tracks: the held-out text reward of greedy answers rises (seeds 0-3:
    0.707 → 0.772, 0.562 → 0.613, 0.561 → 0.624, 0.704 → 0.770; at 30 steps the gains
    spread from -0.02 to +0.06; greedy decoding of a fixed held-out set, so unchanged
    weights would give exactly the same number)."""
    pretrain = tmp_path / "pretrain.toml"
    pretrain.write_text(
        f'[run]\ndir = "{tmp_path / "pre"}"\nsteps = 80\n'
        '[data]\nbatch_size = 32\n[loop]\nbaseline_eval = false\n[log]\nprogress = "off"\n'
        '[trainer]\nkind = "unified_pretrain"\ntask = "sort"\nd_model = 32\nn_heads = 2\n'
        "n_layers = 2\nlr = 3e-3\ngrid_size = 0\n"
    )
    config = make_config(
        tmp_path / "rl",
        {**RL, "task": "sort", "init_from": str(pretrain), "grid_size": 0, "lr": 3e-4,
         "text_eval_size": 128, "text": {"samples_per_prompt": 8}},
        run={"steps": 60}, loop={"eval_interval": 60},
        data={"batch_size": 8},
    )  # fmt: skip
    with anyio.fail_after(120):
        await corun.run(UnifiedTrainer(config), config)
    rewards = [
        r["eval/text/reward"]
        for r in read_records(tmp_path / "rl" / "metrics.jsonl")
        if "eval/text/reward" in r
    ]
    print(f"eval text reward {rewards[0]:.3f} -> {rewards[1]:.3f}")
    assert len(rewards) == 2 and rewards[1] > rewards[0] + 0.03, rewards
