"""What both prompt-enhancer trainers (the supervised warm-up and RL) share: the flow
model (warm-started from flow pretraining), the text policy that rewrites user prompts
(a grammar-masked TinyLM), the user-prompt data, the held-out evaluation (greedy
rewrites → ODE images → rewards against what the user asked for) and state."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
import torch

from corun import CheckpointError, ConfigError, Dataset, Image, SetupContext
from corun.execution import parallel
from trainers.diffusion.base import FlowTrainer
from trainers.diffusion.model import build_model, model_from
from trainers.diffusion.settings import FlowTrainerConfig, NonNegativeFloat
from trainers.diffusion.shapes import captions
from trainers.lm.model import decode
from trainers.lm.policy import load_policy_state, policy_state, sharded
from trainers.pe.prompts import EOS, REWRITE_LEN, UserData, eval_users, flow_tokens
from trainers.pe.rewriter import RewriterLM, build_rewriter, rewriter_from
from trainers.weights import to_device, warm_start_runs, whole_copy

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
TASK = "prompt-enhancer"  # recorded with the text policy's state
SLOTS = ("color", "shape", "place")  # the rewrite's tokens, in order


class PEBaseConfig(FlowTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The flow model's source and the text policy's shape and optimizer."""

    # The flow model: a checkpoint directory, or a .toml config that corun trains first
    # when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    # Text warm start: a prompt-enhancer checkpoint directory, or a .toml config that
    # corun trains first. Empty: a fresh policy of the shape below.
    text_init_from: str = ""
    text_d_model: PositiveInt = 64
    text_n_layers: PositiveInt = 2
    text_n_heads: PositiveInt = 4
    text_lr: PositiveFloat = 1e-3
    text_grad_clip: NonNegativeFloat = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.text_d_model % self.text_n_heads:
            raise ValueError(
                f"`$.text_d_model` ({self.text_d_model}) must be divisible by "
                f"`$.text_n_heads` ({self.text_n_heads})"
            )


C = TypeVar("C", bound=PEBaseConfig)


class PEBase(FlowTrainer[C]):
    # Training prompts in plain words only (the warm-up), or with synonyms (RL).
    plain_prompts: ClassVar[bool] = False
    shards_model = True  # both models, under run.parallel = "fsdp"
    engine_source: RewriterLM | None = None  # a whole copy of the text policy, when sharded

    def prerequisites(self) -> list[str]:
        return warm_start_runs(self.config.init_from, self.config.text_init_from)

    def setup(self, ctx: SetupContext) -> None:
        """The flow model with its optimizer (``image_lr``), the text policy with its
        optimizer (registered as "text"), and the held-out users."""
        cfg = self.config
        self.model = model_from(cfg.init_from) if cfg.init_from else build_model(cfg.model_config())
        self.finish_setup(ctx, self.image_lr())  # the flow model on the run's device
        if cfg.text_init_from:
            policy = rewriter_from(cfg.text_init_from)
        else:
            policy = build_rewriter(cfg.text_d_model, cfg.text_n_layers, cfg.text_n_heads)
        policy.to(self.device)  # before its copy, its shards and its optimizer
        self.engine_source = whole_copy(policy)  # the rollout side holds whole weights
        self.policy = sharded(policy, ctx.config.run.parallel)
        self.text_optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.text_lr)
        ctx.add_optimizer(self.text_optimizer, grad_clip=cfg.text_grad_clip, name="text")
        # Phrased on the CPU (data), moved to the device once: the set is fixed.
        self.eval_users = to_device(eval_users(self.held_out.prompts), self.device)

    def image_lr(self) -> float:
        """The flow model's learning rate (0: the trainer never steps it)."""
        return 0.0

    def dataset(self) -> Dataset:
        if self.run_config.data.path:
            raise ConfigError(
                "data.path: the prompt enhancer generates its prompts; leave it empty"
            )
        data = self.run_config.data
        return UserData(data.batch_size, self.run_config.run.seed, plain=self.plain_prompts)

    # ---- evaluation
    def evaluate(self, step: int | None = None) -> dict[str, float | Image]:
        """Greedy rewrites of held-out user prompts, ODE images of the rewrites from
        fixed noise, scored against what the users asked for; with ``step``, a grid
        captioned "user prompt -> rewrite"."""
        cfg, users = self.config, self.eval_users
        self.policy.eval()
        self.model.eval()
        with parallel.gathered(self.policy):  # decoding enters the model past its hooks
            ids = decode(self.policy, users.prompt_ids, REWRITE_LEN, stop_id=EOS).tokens
        rewrites = flow_tokens(ids)
        labels = [f"{u} -> {r}" for u, r in zip(users.texts, captions(rewrites), strict=True)]
        hits = (rewrites == users.targets).float()
        # Per slot too: the shape is not rewarded, so only colour and place can learn.
        metrics: dict[str, float | Image] = {
            "eval/rewrite_exact": float(hits.all(dim=1).float().mean()),
            **{f"eval/rewrite_{slot}": float(hits[:, i].mean()) for i, slot in enumerate(SLOTS)},
        }
        metrics |= self.held_out.samples(
            self.model, num_steps=cfg.sample_steps, shift=cfg.shift, cfg_scale=cfg.cfg_scale,
            step=step, conditions=rewrites, labels=labels,
        )  # fmt: skip
        if step is not None and cfg.grid_size:
            path = self.held_out.grid_path(step)
            metrics["eval/samples"] = Image(path, f"step {step}: user prompt -> rewrite")
        return metrics

    # ---- observability and resume
    def wandb_extra(self) -> dict[str, Any]:
        return super().wandb_extra() | {"model/text_num_params": self.policy.num_params()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "text": policy_state(self.policy, self.text_optimizer, TASK),
            "image": super().state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not {"text", "image"} <= state.keys():
            raise CheckpointError(
                f"not a prompt-enhancer checkpoint: it holds {sorted(state)}, "
                "not a 'text' and an 'image' side"
            )
        load_policy_state(state["text"], self.policy, self.text_optimizer, TASK)
        super().load_state_dict(state["image"])
