"""What GRPO and PPO share on TinyLM: the policy (from scratch or warm-started from an
SFT run), the rollout engine and its weight sync, sampling and scoring a batch,
optimizer updates over disjoint mini-batches, evaluation and state.

A subclass supplies only its algorithm: how a scored batch becomes training data
(``make_batch``, e.g. group advantages) and the loss of one mini-batch (``loss``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec
import torch
from msgspec.structs import asdict
from torch import Tensor

from corun.data import Dataset
from corun.pipeline import is_config
from corun.trainer import Batch, SetupContext, Trainer
from trainers.common import apply_update, frozen_copy
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.model import TinyLM
from trainers.lm.policy import (
    HeldOutEval,
    build_policy,
    load_policy,
    load_policy_state,
    policy_from,
    policy_state,
    response_logprobs,
)
from trainers.lm.settings import LMTrainerConfig, NonNegativeFloat, PositiveInt
from trainers.lm.tasks import TASKS, Task, TaskData, decode_responses, encode_prompts
from trainers.pg import (
    LossAggregation,
    aggregate,
    clipped_surrogate,
    decoupled_surrogate,
    kl_k3,
)
from trainers.replicas import Replicas

UnitFloat = Annotated[float, msgspec.Meta(gt=0, le=1)]


class RLConfig(LMTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Settings shared by the LM policy-gradient trainers."""

    # Warm start: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 3e-4
    samples_per_prompt: PositiveInt = 8
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    top_p: UnitFloat = 1.0
    # Response length cap; 0 = the task's longest answer + EOS.
    max_new_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # What a response that hit the cap without EOS earns: "zero", or its usual reward.
    truncated_reward: Literal["zero", "keep"] = "zero"
    clip_low: NonNegativeFloat = 0.2
    clip_high: NonNegativeFloat = 0.2  # DAPO clip-higher: e.g. 0.28
    loss_agg: LossAggregation = "token-mean"
    # KL to the frozen initial policy (k3 estimator); 0 skips the reference model.
    kl_coef: NonNegativeFloat = 0.0
    # Optimizer updates per rollout batch, each on a disjoint slice of it.
    mini_batches: PositiveInt = 1
    # Stale batches (concurrency > 1): "decoupled" clips against the weights before
    # this batch's updates and weighs tokens by π_prox/π_behaviour, capped.
    off_policy_correction: Literal["none", "decoupled"] = "none"
    importance_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    # A generation in flight when new weights are published (concurrency > 1):
    # "drain" finishes it on the weights it started with; "interrupt" switches to the
    # new weights between decode steps and continues from the prefix (partial rollout).
    inflight_at_sync: Literal["drain", "interrupt"] = "drain"
    grad_clip: NonNegativeFloat = 1.0
    eval_size: PositiveInt = 512


C = TypeVar("C", bound=RLConfig)


@dataclass
class Scored:
    """A sampled batch with rewards: what ``make_batch`` turns into training data."""

    rollouts: Rollouts
    prompts: list[str]  # one per row
    rewards: Tensor  # (N,)


class LMPolicyTrainer(Trainer[C]):
    """Base of GRPO and PPO on TinyLM; subclasses implement ``make_batch`` and ``loss``."""

    # ---- set-up
    def prerequisites(self) -> list[str]:
        return [self.config.init_from] if is_config(self.config.init_from) else []

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        self.task = TASKS[cfg.task]
        if cfg.init_from:
            self.policy = policy_from(cfg.init_from)
        else:
            self.policy = build_policy(cfg.d_model, cfg.n_layers, cfg.n_heads)
        # The KL anchor is the initial policy, frozen (on resume too: set-up rebuilds it).
        self.reference = frozen_copy(self.policy) if cfg.kl_coef > 0 else None
        self.extra_modules = self.build_extra_modules()
        params = [*self.policy.parameters(), *self.extra_parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        # The rollout engine: the train thread's, updated in place at each sync, and
        # one replica per rollout worker thread (concurrency > 1).
        self.replicas: Replicas[LocalEngine] = Replicas(
            LocalEngine(self.policy), self._engine_replica, LocalEngine.update_weights,
            shared=self.run_config.loop.concurrency > 1, initial=self.policy.state_dict(),
        )  # fmt: skip
        self.engine = self.replicas.home
        self._proximal: Tensor | None = None  # per batch, with the decoupled correction
        self.held_out = HeldOutEval(self.task, cfg.eval_size)
        self.max_new_tokens = cfg.max_new_tokens or self.task.max_answer_len + 1

    def build_extra_modules(self) -> dict[str, torch.nn.Module]:
        """Trainable modules beside the policy (PPO's value head); saved and restored."""
        return {}

    def extra_parameters(self) -> list[torch.nn.Parameter]:
        return [p for module in self.extra_modules.values() for p in module.parameters()]

    def dataset(self) -> Dataset:
        batch_size = self.run_config.data.batch_size * self.prompt_rounds()
        return TaskData(self.task, batch_size, self.run_config.run.seed)

    def prompt_rounds(self) -> int:
        """Prompt batches drawn per step (dynamic sampling draws extra to refill)."""
        return 1

    # ---- rollout
    def rollout(self, examples: list[tuple[str, str]], step: int) -> Batch:
        started = time.monotonic()
        data, metrics = self.make_batch(examples)
        metrics["perf/rollout_total_time_s"] = time.monotonic() - started
        return Batch(data, metrics=metrics, version=data.rollouts.version)

    def sample_and_score(self, examples: list[tuple[str, str]]) -> tuple[Scored, dict[str, float]]:
        """Sample ``samples_per_prompt`` responses per prompt and score them."""
        cfg, n = self.config, self.config.samples_per_prompt
        started = time.monotonic()
        engine = self.replicas.local()[0]
        interrupt = cfg.inflight_at_sync == "interrupt" and engine is not self.engine
        rollouts = engine.generate(
            encode_prompts([p for p, _ in examples]), n, self.max_new_tokens, cfg.temperature,
            cfg.top_p, newer_weights=(lambda: self.replicas.latest) if interrupt else None,
        )  # fmt: skip
        generated = time.monotonic()
        rewards, reward_metrics = task_rewards(
            self.task, examples, rollouts, n, cfg.truncated_reward
        )
        prompts = [p for p, _ in examples for _ in range(n)]
        metrics = {
            **{f"rollout/{key}": value for key, value in reward_metrics.items()},
            # Responses continued by newer weights part-way (interrupt mode).
            "rollout/partial_ratio": float(_spans_versions(rollouts).float().mean()),
            "perf/generate_time_s": generated - started,
            "perf/reward_time_s": time.monotonic() - generated,
        }
        return Scored(rollouts, prompts, rewards), metrics

    def make_batch(self, examples: list[tuple[str, str]]) -> tuple[Any, dict[str, float]]:
        raise NotImplementedError

    # ---- train
    def train_step(self, batch: Batch) -> dict[str, float]:
        """``mini_batches`` optimizer updates over disjoint row slices of the batch."""
        data = self.prepare(batch.data)
        rows = torch.arange(data.rollouts.prompt_ids.shape[0])
        self._proximal = None
        if self.config.off_policy_correction == "decoupled":
            with torch.no_grad():  # the policy before this batch's updates
                self._proximal, _, _ = response_logprobs(
                    self.policy, data.rollouts.sequences, data.rollouts.prompt_ids.shape[1],
                    self.config.temperature,
                )  # fmt: skip
        totals: dict[str, float] = {}
        self.policy.train()
        for part in rows.tensor_split(min(self.config.mini_batches, rows.numel())):
            self.optimizer.zero_grad(set_to_none=True)
            loss, metrics = self.loss(data, part)
            loss.backward()
            params = [*self.policy.parameters(), *self.extra_parameters()]
            grad_norm = apply_update(params, self.optimizer, self.config.grad_clip)
            metrics |= {"train/loss": float(loss.detach()), "train/grad_norm": grad_norm}
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        parts = min(self.config.mini_batches, rows.numel())
        return {key: value / parts for key, value in totals.items()}

    def prepare(self, data: Any) -> Any:
        """Per-batch work before the updates (PPO: old values and GAE)."""
        return data

    def loss(self, data: Any, rows: Tensor) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def policy_loss(
        self, rollouts: Rollouts, rows: Tensor, advantages: Tensor
    ) -> tuple[Tensor, dict[str, float], Tensor]:
        """Clipped surrogate (+ KL) over ``rows``; ``advantages`` is (rows, 1) or (rows, T)."""
        cfg = self.config
        loss, metrics, hidden = clipped_policy_loss(
            self.policy, rollouts.select(rows), advantages, cfg,
            proximal=None if self._proximal is None else self._proximal[rows],
            importance_cap=cfg.importance_cap, reference=self.reference, kl_coef=cfg.kl_coef,
        )  # fmt: skip
        return loss, {f"train/{key}": value for key, value in metrics.items()}, hidden

    # ---- sync, eval, state
    def _engine_replica(self, state: dict[str, Tensor], version: int) -> LocalEngine:
        engine = LocalEngine(
            load_policy({"model_config": asdict(self.policy.config), "model": state})
        )
        engine.version = version
        return engine

    def sync_weights(self, version: int) -> None:
        self.replicas.sync(self.policy.state_dict(), version)

    def evaluate(self) -> dict[str, float]:
        return self.held_out(self.policy)

    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.policy.num_params()}

    def state_dict(self) -> dict[str, Any]:
        extra = {name: module.state_dict() for name, module in self.extra_modules.items()}
        return policy_state(self.policy, self.optimizer, self.config.task, extra=extra)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.policy, self.optimizer, self.config.task)
        for name, module in self.extra_modules.items():
            module.load_state_dict(state["extra"][name])


class PolicyLossSettings(Protocol):
    temperature: float
    clip_low: float
    clip_high: float
    loss_agg: LossAggregation


def task_rewards(
    task: Task, examples: list[tuple[str, str]], rollouts: Rollouts, n: int,
    truncated_reward: str = "keep",
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """Each of the ``n`` responses per example scored by the task (a response cut at
    the length cap earns 0 when ``truncated_reward`` is "zero"), and batch metrics."""
    responses = decode_responses(rollouts.response_ids)
    rewards = torch.tensor([
        0.0 if cut and truncated_reward == "zero" else task.reward(p, a, response)
        for (p, a), response, cut in zip(
            (ex for ex in examples for _ in range(n)), responses, rollouts.truncated.tolist(),
            strict=True,
        )
    ])  # fmt: skip
    return rewards, {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response_len_mean": float(rollouts.response_mask.sum(dim=1).float().mean()),
        "truncated_ratio": float(rollouts.truncated.float().mean()),
    }


def clipped_policy_loss(
    policy: TinyLM, rollouts: Rollouts, advantages: Tensor, settings: PolicyLossSettings, *,
    proximal: Tensor | None = None, importance_cap: float = 1.0,
    reference: TinyLM | None = None, kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float], Tensor]:  # fmt: skip
    """The clipped surrogate of ``rollouts`` under ``policy`` (decoupled against
    ``proximal`` log-probs when given, weights capped at ``importance_cap``), plus
    ``kl_coef`` × k3 KL to ``reference`` when given. Returns the aggregated loss,
    metrics, and the hidden states (a value head's input)."""
    prompt_len = rollouts.prompt_ids.shape[1]
    logp, entropy, hidden = response_logprobs(
        policy, rollouts.sequences, prompt_len, settings.temperature
    )
    mask = rollouts.response_mask
    metrics: dict[str, float] = {}
    if proximal is not None:
        loss_tok, clipped, weights = decoupled_surrogate(
            logp, proximal, rollouts.logprobs, advantages, settings.clip_low,
            settings.clip_high, importance_cap,
        )  # fmt: skip
        metrics["importance_weight_mean"] = _masked_mean(weights, mask)
    else:
        loss_tok, clipped = clipped_surrogate(
            logp, rollouts.logprobs, advantages, settings.clip_low, settings.clip_high
        )
    metrics["clip_ratio"] = _masked_mean(clipped.float(), mask)
    metrics["entropy"] = _masked_mean(entropy.detach(), mask)
    if reference is not None:
        with torch.no_grad():
            ref_logp, _, _ = response_logprobs(
                reference, rollouts.sequences, prompt_len, settings.temperature
            )
        kl = kl_k3(logp, ref_logp)
        loss_tok = loss_tok + kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    else:
        metrics["kl"] = _masked_mean(kl_k3(logp.detach(), rollouts.logprobs), mask)
    return aggregate(loss_tok, mask, settings.loss_agg), metrics, hidden


def _spans_versions(rollouts: Rollouts) -> Tensor:
    versions = rollouts.token_versions.masked_fill(~rollouts.response_mask, rollouts.version)
    return versions.amax(dim=1) > versions.amin(dim=1)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1))
