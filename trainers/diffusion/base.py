"""What the flow-model trainers (pretraining, Flow-GRPO, the prompt enhancer) share:
the model with its optimizer, the shapes data, the held-out evaluation with its sample
grids, and state. A subclass builds the model in ``setup`` and then calls
:meth:`FlowTrainer.finish_setup`; it adds its own rollout and loss."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from corun import ConfigError, Dataset, Image, SetupContext, Trainer
from corun.execution import parallel
from trainers.diffusion.evaluation import HeldOutEval
from trainers.diffusion.model import FlowDiT, load_model_state, model_state
from trainers.diffusion.settings import FlowTrainerConfig
from trainers.diffusion.shapes import ShapeData
from trainers.weights import whole_copy

C = TypeVar("C", bound=FlowTrainerConfig)


class FlowTrainer(Trainer[C]):
    model: FlowDiT
    device: torch.device  # the run's: models, batches, noise and losses; rewards on the CPU
    # Whether finish_setup shards the model under torchrun (run.parallel); the prompt
    # enhancer, which trains a text policy beside it, does not yet.
    shards_model = False
    sampler_source: FlowDiT | None = None  # a whole copy, when the model is sharded
    # Scale of the data's random offsets (shapes.render); pretraining sets its own.
    jitter: float = 1.0

    def finish_setup(self, ctx: SetupContext, lr: float) -> None:
        """``self.model`` on the run's device (``self.device``), its optimizer (the
        subclass registers it, if it trains the model) and the held-out evaluation."""
        cfg = self.config
        self.device = ctx.device
        self.model.to(self.device)  # before its copies, its shards and its optimizer
        if self.shards_model:  # run.parallel = "fsdp": a unit per block
            self.sampler_source = whole_copy(self.model)  # sampling holds whole weights
            parallel.parallelize(
                self.model, strategy=ctx.config.run.parallel, blocks=list(self.model.blocks)
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=cfg.weight_decay
        )
        samples = ctx.config.run_dir / "samples"
        self.held_out = HeldOutEval(cfg.eval_size, self.jitter, samples, cfg.grid_size, self.device)

    def dataset(self) -> Dataset:
        if self.run_config.data.path:
            raise ConfigError("data.path: the flow trainers generate their data; leave it empty")
        data, seed = self.run_config.data, self.run_config.run.seed
        return ShapeData(data.batch_size, seed, self.jitter)

    # ---- evaluation

    def evaluate_baseline(self) -> dict[str, float | Image]:
        return self.evaluate(step=0)

    def evaluate_periodic(self, step: int) -> dict[str, float | Image]:
        return self.evaluate(step=step)

    def evaluate(self, step: int | None = None) -> dict[str, float | Image]:
        """Rewards of ODE samples of the held-out prompts, and the flow-matching loss on
        a fixed batch; with ``step``, also that step's sample grid (a PNG, and an image
        in wandb)."""
        cfg = self.config
        self.model.eval()
        metrics: dict[str, float | Image] = {"eval/loss": self.held_out.loss(self.model)}
        metrics.update(self.held_out.samples(
            self.model, num_steps=cfg.sample_steps, shift=cfg.shift, cfg_scale=cfg.cfg_scale,
            step=step,
        ))  # fmt: skip
        if step is not None and cfg.grid_size:
            metrics["eval/samples"] = Image(self.held_out.grid_path(step), f"step {step}")
        return metrics

    # ---- observability and resume

    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.model.num_params()}

    def state_dict(self) -> dict[str, Any]:
        return model_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_model_state(state, self.model, self.optimizer)
