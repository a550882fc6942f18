"""What both unified-model trainers (pretraining and RL) share: settings, the model with
its one optimizer, the two-track data, the held-out evaluation of both tracks (text:
greedy exact match and reward; image: ODE-sample rewards and a PNG grid), and state.

Every batch, metric and evaluation has a text track and an image track; metric names
carry the track (``train/text/loss``, ``rollout/image/reward_mean``, ``eval/text/reward``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

import msgspec
import torch

from corun import ConfigError, Image, SetupContext, Trainer, TrainerConfig
from trainers.diffusion.evaluation import HeldOutEval as ImageHeldOut
from trainers.diffusion.shapes import ShapeBatch, ShapeData
from trainers.lm.policy import HeldOutEval as TextHeldOut
from trainers.lm.policy import load_policy_state, policy_state
from trainers.lm.settings import NonNegativeFloat, PositiveInt, TaskName
from trainers.lm.tasks import TASKS, TaskData
from trainers.unified.model import MODEL_KIND, UnifiedModel, check_kind, sharded

TextT = TypeVar("TextT")
ImageT = TypeVar("ImageT")


@dataclass(frozen=True)
class Tracks(Generic[TextT, ImageT]):
    """One thing per track: a data batch, a rollout batch."""

    text: TextT
    image: ImageT

    def __len__(self) -> int:
        """The rows of each track (a data batch has as many prompts in both)."""
        text, image = len(self.text), len(self.image)  # type: ignore[arg-type]
        if text != image:
            raise ValueError(f"the tracks have {text} and {image} rows: no common row count")
        return text

    def rows(self, rows: slice) -> Tracks[TextT, ImageT]:
        """The same rows of both tracks (a data-parallel rank's share,
        corun.execution.distributed.shard)."""
        return Tracks(_rows(self.text, rows), _rows(self.image, rows))


def _rows(items: Any, rows: slice) -> Any:
    return items[rows] if isinstance(items, Sequence) else items.rows(rows)


class TrackData:
    """Batch ``i`` of each track's own data set, both pure functions of (seed, i)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, text: TaskData, image: ShapeData) -> None:
        self.text, self.image = text, image

    def batch(self, index: int) -> Tracks[list[tuple[str, str]], ShapeBatch]:
        return Tracks(self.text.batch(index), self.image.batch(index))


def tagged(prefix: str, track: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """``{"loss": x}`` → ``{"<prefix>/<track>/loss": x}``; an existing ``eval/`` is dropped."""
    return {f"{prefix}/{track}/{key.removeprefix('eval/')}": v for key, v in metrics.items()}


class UnifiedSettings(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: TaskName = "sort"  # the text track's task (trainers/lm/tasks.py)
    # Model shape (for a fresh model; a warm start takes the checkpoint's).
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 3
    n_heads: PositiveInt = 4
    patch_size: Annotated[int, msgspec.Meta(ge=1)] = 4
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0  # on the global norm over both tracks' gradients
    # Each track's loss weight in the one optimizer step (0 freezes a track's signal).
    text_weight: NonNegativeFloat = 1.0
    image_weight: NonNegativeFloat = 1.0
    # Scale of the shapes data's random offsets (trainers/diffusion/shapes.render).
    jitter: NonNegativeFloat = 1.0
    # Image sampling in evaluation: Euler ODE steps, time shift, guidance scale.
    sample_steps: PositiveInt = 10
    shift: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    cfg_scale: NonNegativeFloat = 1.0
    # Held-out prompts per evaluation, per track, and images in the PNG grid
    # (<run dir>/samples/step-<N>.png; 0 writes none).
    text_eval_size: PositiveInt = 256
    image_eval_size: PositiveInt = 72
    grid_size: Annotated[int, msgspec.Meta(ge=0)] = 24

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.d_model % 2:
            raise ValueError(
                f"`$.d_model` ({self.d_model}) must be even and divisible by `$.n_heads` "
                f"({self.n_heads})"
            )
        if 16 % self.patch_size:
            raise ValueError(f"`$.patch_size` ({self.patch_size}) must divide the 16-pixel image")


C = TypeVar("C", bound=UnifiedSettings)


class UnifiedBase(Trainer[C]):
    """Set-up, data, evaluation and state of a unified trainer; subclasses add their
    rollout and train step."""

    model: UnifiedModel
    device: torch.device  # the run's: the model, batches, noise and losses; rewards on the CPU
    shards_model = True  # run.parallel = "fsdp"

    def build(self, ctx: SetupContext, model: UnifiedModel) -> None:
        """``model`` on the run's device (``self.device``), one optimizer over every
        parameter of both tracks, and the held-out sets."""
        cfg = self.config
        self.device = ctx.device
        self.model = sharded(model.to(self.device), ctx.config.run.parallel)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip)
        self.task = TASKS[cfg.task]
        self.text_eval = TextHeldOut(self.task, cfg.text_eval_size, self.device)
        samples = ctx.config.run_dir / "samples"
        self.image_eval = ImageHeldOut(
            cfg.image_eval_size, cfg.jitter, samples, cfg.grid_size, self.device
        )

    def dataset(self) -> TrackData:
        data, seed = self.run_config.data, self.run_config.run.seed
        if data.path:
            raise ConfigError("data.path: the unified trainers generate their data; leave it empty")
        text = TaskData(TASKS[self.config.task], data.batch_size, seed)
        return TrackData(text, ShapeData(data.batch_size, seed, self.config.jitter))

    # ---- evaluation

    def evaluate_baseline(self) -> dict[str, float | Image]:
        return self.evaluate(step=0)

    def evaluate_periodic(self, step: int) -> dict[str, float | Image]:
        return self.evaluate(step=step)

    def evaluate(self, step: int | None = None) -> dict[str, float | Image]:
        """Both tracks on their held-out prompts (no draws from the global RNGs); with
        ``step``, also that step's image grid."""
        cfg = self.config
        self.model.eval()
        metrics: dict[str, float | Image] = {}
        metrics |= tagged("eval", "text", self.text_eval(self.model))
        images = self.image_eval.samples(
            self.model.flow, num_steps=cfg.sample_steps, shift=cfg.shift,
            cfg_scale=cfg.cfg_scale, step=step,
        )  # fmt: skip
        metrics |= tagged("eval", "image", images)
        metrics["eval/image/loss"] = self.image_eval.loss(self.model.flow)
        if step is not None and cfg.grid_size:
            grid = self.image_eval.grid_path(step)
            metrics["eval/samples"] = Image(grid, f"step {step}, image track")
        return metrics

    # ---- observability and resume

    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.model.num_params()}

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.model, self.optimizer, self.config.task, model_kind=MODEL_KIND)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state)
        load_policy_state(state, self.model, self.optimizer, self.config.task)
