"""The diffusion pieces: shapes data and rewards, FlowDiT, the ODE/SDE samplers and their
log-probs, PNG grids, and the flow pretraining trainer (directly and through ``run``)."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

import corun
from corun.base.errors import CheckpointError, ConfigError
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.loops import Harness
from tests.support.state import assert_state_equal
from trainers.diffusion import shapes
from trainers.diffusion.grid import save_grid, to_uint8
from trainers.diffusion.model import FlowDiT, FlowModelConfig, load_model, model_from
from trainers.diffusion.pretrain import FlowPretrainConfig, FlowPretrainTrainer
from trainers.diffusion.sampling import (
    sample_ode,
    sample_sde,
    step_log_prob,
    timesteps,
)
from trainers.diffusion.shapes import NULL, Prompt, ShapeData, describe, encode, render, score

KIND = "trainers.diffusion.pretrain:FlowPretrainTrainer"  # entry points may not be installed
REPO = Path(__file__).resolve().parents[1]
TINY = {"kind": KIND, "d_model": 32, "n_layers": 1, "n_heads": 2, "eval_size": 8}


def random_model(seed: int = 0) -> FlowDiT:
    """A tiny FlowDiT with its zero-initialised output layers randomised: v ≠ 0."""
    torch.manual_seed(seed)
    model = FlowDiT(FlowModelConfig(d_model=32, n_layers=1, n_heads=2))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2 and not param.any():
                torch.nn.init.normal_(param, std=0.1)
    return model.eval()


def prompts(n: int, seed: int = 0) -> Tensor:
    return shapes.sample_prompts(shapes.TRAIN_PROMPTS, n, torch.Generator().manual_seed(seed))


def global_rng_states() -> tuple[Any, ...]:
    numpy_state = np.random.get_state(legacy=False)["state"]
    return random.getstate(), numpy_state["key"].tobytes(), torch.get_rng_state()


def assert_same_rng(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert before[:2] == after[:2]
    assert torch.equal(before[2], after[2])


# ----------------------------------------------------------------------------- data


def test_data_is_a_pure_function_of_seed_and_index() -> None:
    before = global_rng_states()
    first = ShapeData(8, seed=3).batch(5)
    assert_same_rng(before, global_rng_states())
    torch.manual_seed(123)
    again = ShapeData(8, seed=3).batch(5)
    assert torch.equal(first.images, again.images) and torch.equal(first.tokens, again.tokens)
    assert not torch.equal(ShapeData(8, seed=3).batch(6).images, first.images)
    assert not torch.equal(ShapeData(8, seed=4).batch(5).images, first.images)
    assert first.images.shape == (8, 3, 16, 16) and first.tokens.shape == (8, 3)
    assert first.images.min() >= -1 and first.images.max() <= 1


def test_eval_prompts_are_held_out_but_their_attribute_pairs_are_trained() -> None:
    assert len(shapes.EVAL_PROMPTS) == 18 and len(shapes.TRAIN_PROMPTS) == 90
    trained = set(shapes.decode(torch.cat([ShapeData(256, 0).batch(i).tokens for i in range(8)])))
    assert trained <= set(shapes.TRAIN_PROMPTS)
    assert not trained & set(shapes.EVAL_PROMPTS)
    pairs = {(p.color, p.place) for p in shapes.TRAIN_PROMPTS}
    assert pairs == {(c, p) for c in shapes.COLORS for p in shapes.PLACES}


def test_prompts_encode_decode_and_describe() -> None:
    prompt = Prompt("red", "disc", "top-left")
    assert describe(prompt) == "red disc top-left"
    assert shapes.decode(encode([prompt])) == [prompt]
    assert shapes.captions(encode([Prompt("cyan", "square", "centre")])) == ["cyan square centre"]
    assert NULL not in encode(shapes.all_prompts()).tolist()
    with pytest.raises(ValueError, match="unknown attribute"):
        encode([Prompt("red", "disc", "middle")])


# ----------------------------------------------------------------------------- rewards


def test_rewards_rank_a_correct_image_above_wrong_ones() -> None:
    tokens = encode(shapes.all_prompts())
    clean = render(tokens, torch.Generator().manual_seed(0), jitter=0.0)
    right = score(clean, tokens)
    assert right.color.min() > 0.9 and right.position.min() > 0.9
    wrong_color, wrong_place = tokens.clone(), tokens.clone()
    wrong_color[:, 0] = 1 + (tokens[:, 0] - 1 + 1) % len(shapes.COLORS)
    wrong_place[:, 2] = tokens[:, 2] + torch.where(tokens[:, 2] == tokens[:, 2].max(), -1, 1)
    assert score(clean, wrong_color).color.max() < 0.1
    assert score(clean, wrong_place).position.max() < 0.1
    assert (score(clean, wrong_color).total < right.total).all()
    assert (score(clean, wrong_place).total < right.total).all()


def test_rewards_grade_imperfect_images() -> None:
    tokens = encode(shapes.all_prompts())
    generator = torch.Generator().manual_seed(0)
    noisy = render(tokens, generator, jitter=0.0) + 0.15 * torch.randn(
        tokens.shape[0], 3, 16, 16, generator=generator
    )
    sloppy = render(tokens, generator, jitter=2.5)
    pure_noise = torch.randn(tokens.shape[0], 3, 16, 16, generator=generator)
    means = [float(score(x, tokens).total.mean()) for x in (noisy, sloppy, pure_noise)]
    assert means[0] > means[1] > means[2]
    assert 0.3 < means[1] < 0.8 and means[2] < 0.05
    for reward in score(pure_noise, tokens):
        assert reward.min() >= 0 and reward.max() <= 1
    empty = score(-torch.ones(4, 3, 16, 16), tokens[:4])
    assert empty.total.max() == 0


# ----------------------------------------------------------------------------- sampling


def test_timestep_grid() -> None:
    uniform, shifted = timesteps(10), timesteps(10, shift=3.0)
    for grid in (uniform, shifted):
        assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()
    assert torch.allclose(uniform, torch.linspace(1, 0, 11))
    assert shifted[1] > uniform[1]  # more of the budget near the noise end


def expected_log_probs(model: FlowDiT, cfg_scale: float, noise_level: float, traj: Any) -> Tensor:
    """The transitions' densities written out from Flow-GRPO's formulas, with torch's Normal."""
    out = []
    grid = traj.timesteps
    for i in range(traj.num_steps):
        x, x_next, t, t_next = traj.latents[:, i], traj.latents[:, i + 1], grid[i], grid[i + 1]
        ts = t.expand(len(x))
        cond = model(x, ts, traj.tokens)
        uncond = model(x, ts, torch.zeros_like(traj.tokens))
        v = uncond + cfg_scale * (cond - uncond)
        sigma = noise_level * torch.sqrt(t / (1 - (grid[1] if i == 0 else t)))
        mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * (t_next - t)
        normal = torch.distributions.Normal(mean, sigma * torch.sqrt(t - t_next))
        out.append(normal.log_prob(x_next).sum(dim=(1, 2, 3)))
    return torch.stack(out, dim=1)


@torch.no_grad()
def test_sde_log_probs_are_the_gaussian_transition_densities() -> None:
    model = random_model()
    generator = torch.Generator().manual_seed(1)
    traj = sample_sde(
        model, prompts(6), num_steps=4, noise_level=0.7, shift=2.0, cfg_scale=2.5,
        generator=generator,
    )  # fmt: skip
    assert traj.log_probs.shape == (6, 4) and traj.latents.shape == (6, 5, 3, 16, 16)
    expected = expected_log_probs(model, 2.5, 0.7, traj)
    assert torch.allclose(traj.log_probs, expected, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_recomputed_log_prob_equals_the_recorded_one(cfg_scale: float) -> None:
    model = random_model()
    traj = sample_sde(
        model, prompts(8), num_steps=5, noise_level=0.8, cfg_scale=cfg_scale,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    rows = torch.tensor([6, 1, 3])
    mini = traj.rows(rows)
    for step in range(traj.num_steps):
        density = step_log_prob(model, mini, step)
        assert density.log_prob.requires_grad
        assert torch.allclose(density.log_prob, traj.log_probs[rows, step], rtol=1e-5, atol=1e-2)
    density.log_prob.sum().backward()
    assert model.patch_out.weight.grad is not None and model.patch_out.weight.grad.abs().sum() > 0
    # Other weights give another density: the recomputation does depend on the model.
    with torch.no_grad():
        other = step_log_prob(random_model(seed=5), mini, 2).log_prob
    assert not torch.allclose(other, traj.log_probs[rows, 2], atol=1.0)
    with pytest.raises(IndexError):
        step_log_prob(model, mini, traj.num_steps)


def test_sde_at_noise_level_zero_is_the_ode_sampler() -> None:
    model, tokens = random_model(), prompts(5)
    noise = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    kwargs: dict[str, Any] = {"num_steps": 6, "shift": 3.0, "cfg_scale": 2.0, "noise": noise}
    ode = sample_ode(model, tokens, **kwargs)
    traj = sample_sde(model, tokens, noise_level=0.0, **kwargs)
    assert torch.equal(traj.images, ode)
    assert torch.isnan(traj.log_probs).all()
    with pytest.raises(ValueError, match="no density"):
        step_log_prob(model, traj, 0)
    noisy = sample_sde(model, tokens, noise_level=0.5, **kwargs)
    assert not torch.allclose(noisy.images, ode, atol=1e-2)


class GaussianFlow:
    """The exact velocity when the data are N(m, s²) per pixel: E[ε − x0 | x_t]."""

    config = FlowModelConfig(image_size=4, channels=1, patch_size=4, d_model=2, n_heads=1)
    m, s = 0.5, 0.3

    def __call__(self, x: Tensor, t: Tensor, tokens: Tensor) -> Tensor:
        t = t.view(-1, 1, 1, 1)
        var = (1 - t) ** 2 * self.s**2 + t**2  # Var(x_t)
        resid = x - (1 - t) * self.m
        x0 = self.m + (1 - t) * self.s**2 / var * resid
        return t / var * resid - x0


def test_sde_sampler_reaches_the_data_distribution() -> None:
    """A wrong drift or noise scale in the SDE step shows up as a wrong spread."""
    tokens = torch.zeros(20_000, 3, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    images = sample_sde(GaussianFlow(), tokens, num_steps=20, noise_level=0.7, generator=generator)
    x = images.images
    assert abs(float(x.mean()) - GaussianFlow.m) < 0.01
    assert abs(float(x.std()) - GaussianFlow.s) < 0.02


def test_samplers_use_only_their_generator() -> None:
    model, tokens = random_model(), prompts(3)
    before = global_rng_states()
    first = sample_sde(model, tokens, num_steps=3, noise_level=0.7,
                       generator=torch.Generator().manual_seed(9))  # fmt: skip
    images = sample_ode(model, tokens, num_steps=3, generator=torch.Generator().manual_seed(9))
    assert_same_rng(before, global_rng_states())
    again = sample_sde(model, tokens, num_steps=3, noise_level=0.7,
                       generator=torch.Generator().manual_seed(9))  # fmt: skip
    assert torch.equal(first.latents, again.latents)
    assert torch.equal(images, sample_ode(model, tokens, num_steps=3,
                                          generator=torch.Generator().manual_seed(9)))  # fmt: skip


# ----------------------------------------------------------------------------- grids


def test_grid_is_a_png_of_scaled_images_with_captions(tmp_path: Path) -> None:
    batch = ShapeData(5, seed=0).batch(0)
    path = save_grid(batch.images, shapes.captions(batch.tokens), tmp_path / "g.png", columns=3)
    assert path == tmp_path / "g.png" and [p.name for p in tmp_path.iterdir()] == ["g.png"]
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert width == 3 * (64 + 8)
        assert 2 * 64 < height < 2 * (64 + 60)  # two rows of 64-pixel tiles and captions
        pixels = np.asarray(image.convert("RGB"))
    source = to_uint8(batch.images).numpy()
    # Nearest-neighbour ×4: source pixel (7, 9) of image 1 fills a 4×4 block of its tile,
    # which starts 4 px in from its 72-pixel column.
    for dy in range(4):
        for dx in range(4):
            assert (pixels[4 + 4 * 7 + dy, 72 + 4 + 4 * 9 + dx] == source[1, 7, 9]).all()
    with pytest.raises(ValueError, match="one caption per image"):
        save_grid(batch.images, ["x"], tmp_path / "bad.png")


# ----------------------------------------------------------------------------- trainer


def trainer_config(tmp_path: Path, **trainer: Any) -> corun.Config:
    return make_config(tmp_path, {**TINY, **trainer}, data={"batch_size": 16})


def make_trainer(tmp_path: Path, seed: int = 0, **trainer: Any) -> Harness[FlowPretrainTrainer]:
    return Harness(FlowPretrainTrainer, trainer_config(tmp_path, **trainer), seed=seed)


def train(flow: Harness[FlowPretrainTrainer], steps: range) -> list[float]:
    return [metrics["train/loss"] for metrics in flow.train(steps)]


@pytest.mark.parametrize(
    ("key", "value"),
    [("cond_dropout", 1.0), ("patch_size", 3), ("n_heads", 3), ("sample_steps", 0),
     ("lr", 0.0), ("jitter", -1.0), ("bogus", 1)],
)  # fmt: skip
def test_config_rejects_bad_values(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=r"\$\.trainer"):
        trainer_config(tmp_path, **{key: value})


def test_shipped_config_loads() -> None:
    shipped = corun.load_config(
        REPO / "configs/diffusion_pretrain.toml", [f"trainer.kind={KIND}"]
    )
    assert isinstance(shipped.trainer, FlowPretrainConfig) and shipped.trainer.jitter > 1


def test_state_dict_round_trip(tmp_path: Path) -> None:
    flow = make_trainer(tmp_path / "a")
    train(flow, range(2))
    buffer = io.BytesIO()
    torch.save(flow.trainer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # how checkpoints load: no pickled objects
    other = make_trainer(tmp_path / "b", seed=1)
    other.trainer.load_state_dict(state)
    for key, value in flow.trainer.model.state_dict().items():
        assert torch.equal(value, other.trainer.model.state_dict()[key]), key
    assert train(flow, range(2, 4)) == train(other, range(2, 4))  # optimizer state came too
    assert isinstance(load_model(state), FlowDiT)
    wider = make_trainer(tmp_path / "c", d_model=64)
    with pytest.raises(CheckpointError, match="checkpoint is for model"):
        wider.trainer.load_state_dict(state)


def test_rollout_and_evaluate_are_deterministic_and_leave_global_rng(tmp_path: Path) -> None:
    harness = make_trainer(tmp_path, grid_size=4, cond_dropout=0.5)
    flow = harness.trainer
    before = global_rng_states()
    first, again = harness.rollout(3).data, harness.rollout(3).data
    metrics = flow.evaluate(step=7)
    assert metrics.pop("eval/samples") == corun.Image(flow.held_out.grid_path(7), "step 7")
    assert flow.evaluate() == metrics
    assert_same_rng(before, global_rng_states())
    assert torch.equal(first.noise, again.noise) and torch.equal(first.tokens, again.tokens)
    # Condition dropout blanks whole prompts, never single attributes.
    dropped, kept = (first.tokens == NULL).all(dim=1), (first.tokens != NULL).all(dim=1)
    assert dropped.any() and kept.any() and bool((dropped | kept).all())
    assert set(metrics) == {
        "eval/loss", "eval/reward", "eval/color_reward", "eval/position_reward"
    }  # fmt: skip
    assert flow.held_out.grid_path(7).is_file()
    with pytest.raises(ConfigError, match=r"data\.path"):
        FlowPretrainTrainer(make_config(tmp_path, TINY, data={"path": "x.jsonl"})).dataset()


@pytest.mark.anyio
async def test_pretrain_run_lowers_the_flow_matching_loss(
    tmp_path: Path, anyio_backend: str
) -> None:
    config = make_config(
        tmp_path,
        {**TINY, "lr": 1e-2, "sample_steps": 4, "grid_size": 4},
        run={"steps": 20, "seed": 0},
        loop={"eval_interval": 20},
        data={"batch_size": 16},
    )
    trainer = FlowPretrainTrainer(config)
    with anyio.fail_after(60):
        outcome = await corun.run(trainer, config)
    assert outcome.reason == "done"
    evals = [r for r in read_records(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 20]
    assert evals[1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]  # ~1.7 → ~1.0
    assert all(not math.isnan(r["eval/reward"]) for r in evals)
    assert {p.name for p in (tmp_path / "samples").iterdir()} == {"step-0.png", "step-20.png"}
    assert evals[1]["eval/samples"] == str(tmp_path / "samples" / "step-20.png")
    warm = model_from(str(tmp_path / "checkpoints" / "step-20"))
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, warm.state_dict()[key]), key


@pytest.mark.anyio
async def test_resumed_pretrain_equals_uninterrupted(tmp_path: Path, anyio_backend: str) -> None:
    def config(run_dir: Path, steps: int) -> corun.Config:
        return make_config(
            run_dir, {**TINY, "grid_size": 0}, run={"steps": steps, "seed": 1},
            loop={"save_interval": 3, "baseline_eval": False}, data={"batch_size": 8},
        )  # fmt: skip

    with anyio.fail_after(60):
        straight = FlowPretrainTrainer(config(tmp_path / "straight", 6))
        await corun.run(straight, straight.run_config)
        first = FlowPretrainTrainer(config(tmp_path / "split", 3))
        await corun.run(first, first.run_config)
        resumed = FlowPretrainTrainer(config(tmp_path / "split", 6))
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())
