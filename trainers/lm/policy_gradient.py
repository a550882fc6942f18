"""What every LM policy-gradient trainer shares, whatever its policy (TinyLM, or a
Hugging Face causal LM) and wherever its batches come from (prompts, agent episodes):
the policy (fresh or warm-started) with its KL anchor and optimizer, per-batch
preparation (the decoupled correction's proximal log-probs), and the clipped policy
loss over the policy's tokens.

The algorithm is an object the trainer holds (``Algorithm``: GRPO or PPO,
trainers/lm/grpo.py and ppo.py): how a scored batch becomes training data and the loss
of a slice of its rows. A subclass supplies the policy (``initial_policy``), the
rollout engine and its sync, the task (``dataset``, ``rollout``, ``evaluate``) and the
state: trainers/lm/rl.py for a TinyLM on local engines, trainers/hf/rl.py for an hf:
policy. The runtime splits batches into ``loop.mini_batches`` optimizer steps and
applies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, ClassVar, Generic, Literal, Protocol, Self, TypeVar

import msgspec
import torch
from torch import Tensor, nn

from corun import Batch, ConfigError, Part, Rows, SetupContext, Trainer, shared_count
from trainers.lm.engine import Rollouts
from trainers.lm.policy import CausalPolicy, rollout_logprobs
from trainers.lm.settings import LMTrainerConfig, NonNegativeFloat, PositiveInt
from trainers.pg import (
    CORRECTION_SETTINGS,
    Correction,
    CorrectionResult,
    LossAggregation,
    aggregate,
    clipped_surrogate,
    decoupled_surrogate,
    kl_k3,
    mismatch_metrics,
    rollout_correction,
)
from trainers.weights import kl_anchor, to_device, warm_start_runs

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
    # Cap on each token's k3 estimate (verl caps at 10), so one token far from the
    # reference cannot dominate the loss; unset: uncapped.
    kl_clamp: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Dual clip (Ye et al. 2019; verl uses 3): with a negative advantage a token's loss
    # is capped at -A·c, so a token whose ratio grew far (stale) cannot dominate;
    # unset: off.
    dual_clip: Annotated[float, msgspec.Meta(gt=1)] | None = None
    # Stale batches (concurrency > 1): "decoupled" clips against the weights before
    # this batch's updates and weighs tokens by π_prox/π_behaviour, capped.
    off_policy_correction: Literal["none", "decoupled"] = "none"
    importance_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    # How the engine's log-probs enter the loss (docs/corrections.md). "none": the PPO
    # ratio is taken against them as recorded. A correction ("token-tis", "seq-tis",
    # "token-mis", "seq-mis", "geo-rs", "icepop"): the ratio is clipped against the
    # trainer's own log-probs before this batch's update, and each token is weighted or
    # masked by the correction of π_trainer / π_engine (replacing the decoupled
    # objective's capped weight). Unset: "none" — except in an async run whose engine is
    # not the trainer's own model (vLLM, another precision), which must choose.
    rollout_correction: Correction | None = None
    correction_cap: Annotated[float, msgspec.Meta(ge=1)] | None = None  # the TIS cap
    correction_low: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # a band's
    correction_high: Annotated[float, msgspec.Meta(ge=1)] | None = None  # bounds
    # Mismatch diagnostics (every step): the |log ratio| past which a token counts as
    # mismatched (mismatch/share_over), and the per-token KL estimate (k3) past which a
    # step is reported as a warning: a broken engine setup shows at step 1.
    mismatch_threshold: Annotated[float, msgspec.Meta(ge=0)] = 0.6931471805599453  # log 2
    mismatch_bound: Annotated[float, msgspec.Meta(gt=0)] = 0.01
    # A generation in flight when new weights are published (concurrency > 1):
    # "drain" finishes it on the weights it started with; "interrupt" switches to the
    # new weights between decode steps and continues from the prefix (partial rollout;
    # timing decides where, so not with loop.version_schedule = "fixed").
    inflight_at_sync: Literal["drain", "interrupt"] = "drain"
    grad_clip: NonNegativeFloat = 1.0
    eval_size: PositiveInt = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        check_correction(self)


def require_correction(config: RLConfig, concurrency: int, engine: str) -> None:
    """An async run (``concurrency`` > 1) whose ``engine`` (described, e.g. "'vllm'") does
    not compute the trainer's own log-probs must choose its rollout correction."""
    if concurrency > 1 and config.rollout_correction is None:
        options = ", ".join(f'"{name}"' for name in CORRECTION_SETTINGS)
        raise ConfigError(
            f"`$.trainer.rollout_correction`: an async run (loop.concurrency = "
            f"{concurrency}) with {engine}, whose log-probs are not the trainer's, must "
            f"choose how they are corrected: one of {options} (docs/corrections.md)"
        )


def check_correction(config: RLConfig) -> None:
    """A correction setting the chosen correction does not take, or a band that is not
    one: refused, naming the key."""
    kind = config.rollout_correction or "none"
    settings = {"cap": config.correction_cap, "low": config.correction_low,
                "high": config.correction_high}  # fmt: skip
    for name, value in settings.items():
        if value is not None and name not in CORRECTION_SETTINGS[kind]:
            takes = ", ".join(f"correction_{s}" for s in CORRECTION_SETTINGS[kind]) or "none"
            raise ValueError(f"`$.correction_{name}`: rollout_correction = {kind!r} takes {takes}")
    try:  # the bounds' own checks (a band's low below its high, ...)
        zeros = torch.zeros(1, 1)
        rollout_correction(
            kind, zeros, zeros, torch.ones(1, 1, dtype=torch.bool), cap=config.correction_cap,
            low=config.correction_low, high=config.correction_high,
        )  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"`$.rollout_correction` = {kind!r}: {exc}") from None


C = TypeVar("C", bound=RLConfig)
A = TypeVar("A", bound=RLConfig)
D = TypeVar("D")


@dataclass
class Scored:
    """A sampled batch with rewards: what ``make_batch`` turns into training data. Its
    tensors are on the run's device (rewards, computed on the CPU, moved once)."""

    rollouts: Rollouts
    prompts: list[str]  # one per row
    rewards: Tensor  # (N,)
    # A teacher's log-probs of the response tokens (N, T), under on-policy distillation
    # (trainers/lm/distill.py); 0 past each response. With its whole log-prob rows
    # (N, T, vocab) when the exact reverse KL is taken.
    teacher_logprobs: Tensor | None = None
    teacher_rows: Tensor | None = None


# Decoupled correction's proximal log-probs: computed, "own" (the loss's forward pass
# runs on the proximal weights: the batch's first optimizer step), or None (no correction).
Proximal = Tensor | Literal["own"] | None


@dataclass
class Prepared(Generic[D]):
    """A batch's training data after ``prepare``."""

    data: D
    # Log-probs under the weights before this batch's update (decoupled correction);
    # None: no correction, or the first mini-batch's own log-probs are them.
    proximal: Tensor | None
    decoupled: bool = False


class TrainablePolicy(CausalPolicy, Protocol):
    """A policy the update trains: TinyLM, or a Hugging Face causal LM (nn.Modules)."""

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool = True) -> Self: ...

    def eval(self) -> Self: ...

    def to(self, device: torch.device) -> Self: ...

    def num_params(self) -> int: ...


@dataclass
class MiniBatch:
    """What a chunk of rows (the update's token budget split its mini-batch) divides by
    and gathers into: the whole mini-batch's rows (``whole``), its loss's kept tokens
    (``keep``: a rejecting correction's, else the response mask), and the per-token
    values the mini-batch's own metrics are computed from at its last chunk."""

    whole: Rollouts
    keep: Tensor
    rows: Tensor  # this chunk's rows, as positions in the mini-batch
    last: bool
    horizon: int  # the batch's response width, before any chunk was cut
    gathered: dict[str, Tensor] = field(default_factory=dict)

    @property
    def mask(self) -> Tensor:
        return self.whole.response_mask

    def gather(self, name: str, values: Tensor) -> Tensor | None:
        """Put this chunk's (rows, width) ``values`` in place; the mini-batch's whole
        (rows, T) tensor once the last chunk is in, else None."""
        full = self.gathered.get(name)
        if full is None:
            full = self.gathered[name] = torch.zeros_like(self.mask, dtype=values.dtype)
        full[self.rows, : values.shape[1]] = values
        return full if self.last else None


@dataclass
class PolicyLoss:
    """A slice of rows' clipped policy loss, given their advantages (rows, 1) or (rows, T):
    ``policy_loss(rollouts, rows, advantages)`` returns the loss, its metrics and the
    hidden states (a value head's input). An algorithm reduces its own per-token terms
    with :meth:`aggregate` and :meth:`mean`, which divide as the policy loss does: by
    the whole mini-batch's counts when the rows are a chunk of it."""

    compute: Callable[..., tuple[Tensor, dict[str, float], Tensor]]
    counts: MiniBatch | None = None

    def __call__(
        self, rollouts: Rollouts, rows: Rows, advantages: Tensor
    ) -> tuple[Tensor, dict[str, float], Tensor]:
        return self.compute(rollouts, rows, advantages, counts=self.counts)

    def aggregate(self, values: Tensor, mask: Tensor, mode: LossAggregation) -> Tensor:
        counts = self.counts
        if counts is None:
            return aggregate(values, mask, mode, shared_count)
        return aggregate(values, mask, mode, shared_count, counts.mask, counts.horizon)

    def mean(self, values: Tensor, mask: Tensor) -> float:
        """The token mean of ``values`` over ``mask`` (a chunk's share of it)."""
        whole = mask if self.counts is None else self.counts.mask
        return _masked_mean(values, mask, shared_count(whole.sum()).clamp(min=1))


class PolicyGradientAlgorithm(Generic[A]):
    """What GRPO and PPO add to the shared update (trainers/lm/grpo.py, ppo.py), whatever
    makes the scored batches (prompts, agent episodes, an hf: policy's engine)."""

    def __init__(self, config: A) -> None:
        self.config = config

    def check(self) -> None:
        """Refuse (one line) what this run cannot apply, before any rollout."""

    def modules(self, policy: CausalPolicy) -> dict[str, nn.Module]:
        """Trainable modules beside the policy (PPO's value head); saved and restored."""
        return {}

    def training_data(self, scored: Scored) -> Any:
        """A scored batch as the algorithm trains on it (GRPO: with group advantages)."""
        raise NotImplementedError

    def prepare(self, data: Any, policy: CausalPolicy) -> Any:
        """Per-batch work under the weights it is trained from (PPO: old values, GAE)."""
        return data

    def rows_loss(
        self, data: Any, rows: Rows, policy_loss: PolicyLoss
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of ``rows`` of a prepared batch, from their clipped policy loss; its
        own per-token terms reduced by ``policy_loss.aggregate`` and ``.mean``."""
        raise NotImplementedError


class PolicyGradientTrainer(Trainer[C]):
    """Base of the LM policy-gradient trainers: :meth:`build` makes the policy, its KL
    anchor, the algorithm (``Algorithm``) with its modules, and the optimizer; the
    update (prepare, loss) is this class's. A subclass supplies the policy
    (``initial_policy``), the rollout engine, the task and the state."""

    Algorithm: ClassVar[type[PolicyGradientAlgorithm[Any]]]
    policy: TrainablePolicy

    def prerequisites(self) -> list[str]:
        return warm_start_runs(self.config.init_from)

    # ---- set-up
    def build(self, ctx: SetupContext) -> None:
        """The algorithm, the policy and what trains it (blocking: loading weights)."""
        cfg = self.config
        self.algorithm = self.Algorithm(cfg)
        self.algorithm.check()
        if cfg.inflight_at_sync == "interrupt" and ctx.config.loop.version_schedule == "fixed":
            raise ConfigError(
                '`$.trainer.inflight_at_sync` = "interrupt": a partial rollout switches weights '
                'when a publish happens to come, which loop.version_schedule = "fixed" forbids'
            )
        # Several optimizer steps per batch: the later ones need the proximal log-probs
        # computed before the first (prepare); with one, its own forward pass has them
        # (unless the token budget splits that pass).
        self.later_mini_batches = ctx.config.loop.mini_batches > 1
        # The per-token values of the mini-batch being split, gathered chunk by chunk.
        self.gathered: dict[str, Tensor] = {}
        # The models on the run's device before the reference and the engine copy the
        # policy, and before the optimizer takes their parameters.
        self.device = ctx.device
        policy = self.initial_policy().to(self.device)
        self.reference = kl_anchor(policy, cfg.kl_coef)
        self.policy = self.trained_policy(policy)
        modules = self.algorithm.modules(self.policy).items()
        self.extra_modules = {name: module.to(self.device) for name, module in modules}
        groups, extra = self.policy_groups(cfg.lr), self.extra_parameters()
        if extra and len(groups) == 1 and "lr" not in groups[0]:  # one, as checkpoints have
            groups = [{"params": [*groups[0]["params"], *extra]}]
        elif extra:  # value heads and the like at lr
            groups.append({"params": extra})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
        ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip)

    def training_data(self, scored: Scored) -> Any:
        """The algorithm's training data of ``scored``, a batch built on the CPU from
        generations and rewards: moved to the run's device once, whole."""
        return self.algorithm.training_data(to_device(scored, self.device))

    def policy_groups(self, lr: float) -> list[dict[str, Any]]:
        """The optimizer's parameter groups of the policy's trained parameters: one at
        ``lr`` here; LoRA's adapters at rates of their own (trainers/hf/lora.py)."""
        return [{"params": [p for p in self.policy.parameters() if p.requires_grad]}]

    def initial_policy(self) -> TrainablePolicy:
        """The policy to start from: a warm start's, or a fresh one."""
        raise NotImplementedError

    def trained_policy(self, policy: Any) -> Any:
        """``policy`` (the reference has been copied from it) as the optimizer trains
        it: sharded over the ranks, say (trainers/hf/rl.py)."""
        return policy

    def extra_parameters(self) -> list[nn.Parameter]:
        return [p for module in self.extra_modules.values() for p in module.parameters()]

    # ---- train
    def row_tokens(self, batch: Batch) -> list[int]:
        """Each row's prompt and response up to its last trained token: a chunk of rows
        is cut to its longest (:meth:`Rollouts.trimmed`)."""
        data = batch.data.data if isinstance(batch.data, Prepared) else batch.data
        rollouts: Rollouts = data.rollouts
        return rollouts.row_tokens()

    def prepare(self, batch: Batch) -> Prepared[Any]:
        data = self.algorithm.prepare(batch.data, self.policy)
        proximal = None
        # A correction, like the decoupled objective, anchors the ratio at the trainer's
        # own log-probs before this batch's update.
        corrected = (self.config.rollout_correction or "none") != "none"
        decoupled = self.config.off_policy_correction == "decoupled" or corrected
        # Split into chunks, no one forward pass sees the whole mini-batch, whose kept
        # tokens (a rejecting correction's) every chunk's loss divides by.
        if decoupled and (self.later_mini_batches or batch.split):
            rollouts = data.rollouts
            with torch.no_grad():  # the policy before this batch's update
                proximal, _, _ = rollout_logprobs(
                    self.policy, rollouts, self.config.temperature, chunk=self.config.logits_chunk
                )  # fmt: skip
        return Prepared(data, proximal, decoupled)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        prepared: Prepared[Any] = batch.data
        self.policy.train()
        rows = part.rows(prepared.data.rollouts.prompt_ids.shape[0])
        proximal: Proximal = prepared.proximal
        if prepared.decoupled and part.mini == 0 and not part.split:
            proximal = "own"  # no step applied since prepare: the loss's forward has them
        # Mini-batch 0 computes with the weights of version ``part.version``: its own
        # log-probs against the engine's are the diagnostics.
        diagnose = part.version if part.mini == 0 else None
        if part.split:
            return self.chunk_loss(prepared.data, part, proximal, diagnose)
        return self.rows_loss(prepared.data, rows, proximal, diagnose)

    def chunk_loss(
        self, data: Any, part: Part, proximal: Proximal, diagnose: int | None
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of a chunk of a mini-batch's rows, cut to its longest row: its share
        of the mini-batch's loss and metrics (corun/loop/micro_batches.py)."""
        rollouts: Rollouts = data.rollouts
        n, horizon = rollouts.prompt_ids.shape[0], rollouts.response_ids.shape[1]
        rows, mini = part.rows(n), part.mini_rows(n)
        assert isinstance(rows, Tensor) and isinstance(proximal, Tensor | None)
        whole = rollouts.select(mini)
        keep = whole.response_mask
        gap = EngineGap.of(self.config, None, False)
        if proximal is not None and gap.correction != "none":
            keep = gap.correct(proximal[mini], whole).keep  # a rejection's, decided up front
        if part.chunk == 0:
            self.gathered = {}
        counts = MiniBatch(whole, keep, rows.to(keep.device) - mini.start, part.last_chunk,
                           horizon, self.gathered)  # fmt: skip
        chunk = select_rows(data, rows, horizon)
        width = chunk.rollouts.response_ids.shape[1]
        if isinstance(proximal, Tensor):
            proximal = proximal[rows.to(proximal.device), :width]
        compute = partial(self.policy_loss, proximal=proximal, diagnose=diagnose)
        return self.algorithm.rows_loss(chunk, slice(None), PolicyLoss(compute, counts))

    def rows_loss(
        self, data: Any, rows: Rows, proximal: Proximal, diagnose: int | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        policy_loss = partial(self.policy_loss, proximal=proximal, diagnose=diagnose)
        return self.algorithm.rows_loss(data, rows, PolicyLoss(policy_loss))

    def policy_loss(
        self, rollouts: Rollouts, rows: Rows, advantages: Tensor, proximal: Proximal,
        diagnose: int | None = None, counts: MiniBatch | None = None,
    ) -> tuple[Tensor, dict[str, float], Tensor]:  # fmt: skip
        """Clipped surrogate (+ KL) over ``rows``; ``advantages`` is (rows, 1) or (rows, T).
        ``diagnose``: the version of the weights computing, when the engine's log-probs
        are to be compared with them (mini-batch 0). ``counts``: the mini-batch the rows
        are a chunk of (already selected: ``rows`` is all of them)."""
        cfg = self.config
        if counts is None and isinstance(proximal, Tensor):
            proximal = proximal[rows]
        return clipped_policy_loss(
            self.policy, rollouts.select(rows), advantages, cfg, proximal=proximal,
            importance_cap=cfg.importance_cap, reference=self.reference, kl_coef=cfg.kl_coef,
            kl_clamp=cfg.kl_clamp, dual_clip=cfg.dual_clip,
            gap=EngineGap.of(cfg, diagnose, self.run_config.loop.concurrency > 1), counts=counts,
        )  # fmt: skip

    # ---- observability and state
    def wandb_extra(self) -> dict[str, Any]:
        return {"model/num_params": self.policy.num_params()}

    def modules_state(self) -> dict[str, Any]:
        """The algorithm's modules' state (saved under ``"extra"``)."""
        return {name: module.state_dict() for name, module in self.extra_modules.items()}

    def load_modules_state(self, state: dict[str, Any]) -> None:
        for name, module in self.extra_modules.items():
            module.load_state_dict(state["extra"][name])


def select_rows(data: Any, rows: Tensor, horizon: int) -> Any:
    """``rows`` of an algorithm's batch (a dataclass of per-row tensors around its
    ``rollouts``), cut to their longest row: the rollouts trimmed, and every other
    tensor's response axis (the second, ``horizon`` wide) cut to the same width."""
    rollouts: Rollouts = data.rollouts.select(rows.to(data.rollouts.prompt_ids.device)).trimmed()
    width = rollouts.response_ids.shape[1]
    fields: dict[str, Any] = {"rollouts": rollouts}
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if f.name == "rollouts" or not isinstance(value, Tensor):
            continue
        value = value[rows.to(value.device)]
        cut = value.dim() > 1 and value.shape[1] == horizon
        fields[f.name] = value[:, :width] if cut else value
    return dataclasses.replace(data, **fields)


class PolicyLossSettings(Protocol):
    # Read-only, as the frozen config Structs that satisfy it.
    @property
    def temperature(self) -> float: ...
    @property
    def logits_chunk(self) -> int: ...
    @property
    def clip_low(self) -> float: ...
    @property
    def clip_high(self) -> float: ...
    @property
    def loss_agg(self) -> LossAggregation: ...


@dataclass(frozen=True)
class EngineGap:
    """How a loss treats the engine's log-probs beside the trainer's: the correction
    (``RLConfig.rollout_correction`` and its settings) and, when ``version`` is given,
    the diagnostics against the weights of that version (``mismatch/*`` over the tokens
    sampled by them; in an async run also ``offpolicy/*`` over older tokens, where
    staleness adds to the mismatch)."""

    correction: Correction = "none"
    cap: float | None = None
    low: float | None = None
    high: float | None = None
    threshold: float = 0.6931471805599453
    bound: float = 0.01
    version: int | None = None
    stale: bool = False  # async: report the older tokens separately

    @classmethod
    def of(cls, config: RLConfig, version: int | None, stale: bool) -> EngineGap:
        return cls(
            config.rollout_correction or "none", config.correction_cap, config.correction_low,
            config.correction_high, config.mismatch_threshold, config.mismatch_bound, version,
            stale,
        )  # fmt: skip

    def batch_metrics(
        self, logp: Tensor, anchor: Tensor, rollouts: Rollouts, counts: MiniBatch | None,
        corrected: CorrectionResult | None,
    ) -> dict[str, float]:  # fmt: skip
        """The correction's (``corrected``'s, of these rows) and the diagnostics' metrics
        of the batch, or, for a chunk, of its whole mini-batch: gathered, and computed
        once its last chunk is in."""
        if counts is None:
            known = {} if corrected is None else corrected.metrics
            return known | self.diagnostics(logp, rollouts)
        whole_logp, whole_anchor = counts.gather("logp", logp), counts.gather("anchor", anchor)
        if whole_logp is None or whole_anchor is None:
            return {}
        whole = counts.whole
        metrics = {} if corrected is None else self.correct(whole_anchor, whole).metrics
        return metrics | self.diagnostics(whole_logp, whole)

    def correct(self, logp: Tensor, rollouts: Rollouts) -> CorrectionResult:
        return rollout_correction(
            self.correction, logp, rollouts.logprobs, rollouts.response_mask, cap=self.cap,
            low=self.low, high=self.high, shared=shared_count,
        )  # fmt: skip

    def diagnostics(self, logp: Tensor, rollouts: Rollouts) -> dict[str, float]:
        """The engine's log-probs against ``logp`` (the trainer's, at ``version``), and
        ``alert/mismatch_k3``: the k3 estimate where it exceeds the bound, else 0."""
        if self.version is None:
            return {}
        mask = rollouts.response_mask
        current = mask & (rollouts.token_versions == self.version)
        metrics = mismatch_metrics(logp, rollouts.logprobs, current,
                                   threshold=self.threshold, shared=shared_count)  # fmt: skip
        if self.stale:
            older = mismatch_metrics(logp, rollouts.logprobs, mask & ~current,
                                     threshold=self.threshold, shared=shared_count)  # fmt: skip
            metrics |= {k.replace("mismatch/", "offpolicy/"): v for k, v in older.items()}
        k3 = metrics["mismatch/k3"]
        return metrics | {"alert/mismatch_k3": k3 if k3 > self.bound else 0.0}


def clipped_policy_loss(
    policy: CausalPolicy, rollouts: Rollouts, advantages: Tensor, settings: PolicyLossSettings,
    *, proximal: Proximal = None, importance_cap: float = 1.0,
    reference: CausalPolicy | None = None, kl_coef: float = 0.0, kl_clamp: float | None = None,
    dual_clip: float | None = None, gap: EngineGap | None = None, counts: MiniBatch | None = None,
) -> tuple[Tensor, dict[str, float], Tensor]:  # fmt: skip
    """The clipped surrogate of ``rollouts`` under ``policy`` (decoupled against
    ``proximal`` log-probs when given — ``"own"``: the policy's own, detached —, weights
    capped at ``importance_cap``, or, with ``gap``'s correction, the correction's;
    dual clip at ``dual_clip``), plus ``kl_coef`` × k3 KL (capped at ``kl_clamp``) to
    ``reference`` when given, and ``gap``'s diagnostics. ``counts``: the mini-batch
    these rows are a chunk of, whose counts the loss and the metrics divide by (each
    then a share). Returns the aggregated loss, metrics, and the hidden states (a value
    head's input)."""
    chunk = settings.logits_chunk
    logp, entropy, hidden = rollout_logprobs(policy, rollouts, settings.temperature, chunk=chunk)
    mask = keep = rollouts.response_mask
    # The metrics' token means divide by the shared count too: averaged over the ranks
    # (corun/loop/update.py), they are the token means of the whole batch.
    tokens = shared_count((mask if counts is None else counts.mask).sum()).clamp(min=1)
    metrics: dict[str, float] = {}
    if isinstance(proximal, str):  # "own": the weights are the proximal policy's
        proximal = logp.detach()
    anchor = logp.detach() if proximal is None else proximal
    corrected = None
    if gap is not None and gap.correction != "none":
        corrected = gap.correct(anchor, rollouts)
        loss_tok, clipped = clipped_surrogate(
            logp, anchor, advantages, settings.clip_low, settings.clip_high,
            clip_ratio_c=dual_clip,
        )  # fmt: skip
        loss_tok, keep = corrected.weights * loss_tok, corrected.keep
    elif proximal is not None:
        loss_tok, clipped, weights = decoupled_surrogate(
            logp, proximal, rollouts.logprobs, advantages, settings.clip_low,
            settings.clip_high, importance_cap, clip_ratio_c=dual_clip,
        )  # fmt: skip
        metrics["importance_weight_mean"] = _masked_mean(weights, mask, tokens)
    else:
        loss_tok, clipped = clipped_surrogate(
            logp, rollouts.logprobs, advantages, settings.clip_low, settings.clip_high,
            clip_ratio_c=dual_clip,
        )  # fmt: skip
    metrics["clip_ratio"] = _masked_mean(clipped.float(), mask, tokens)
    metrics["entropy"] = _masked_mean(entropy.detach(), mask, tokens)
    if reference is not None:
        with torch.no_grad():
            ref_logp, _, _ = rollout_logprobs(
                reference, rollouts, settings.temperature, chunk=chunk
            )
        kl = kl_k3(logp, ref_logp, clamp=kl_clamp)
        loss_tok = loss_tok + kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask, tokens)
    else:
        metrics["kl"] = _masked_mean(kl_k3(logp.detach(), rollouts.logprobs), mask, tokens)
    if gap is not None:
        metrics |= gap.batch_metrics(logp.detach(), anchor, rollouts, counts, corrected)
    whole, horizon = (None, None) if counts is None else (counts.keep, counts.horizon)
    loss = aggregate(loss_tok, keep, settings.loss_agg, shared_count, whole, horizon)
    return loss, metrics, hidden


def _masked_mean(values: Tensor, mask: Tensor, tokens: Tensor) -> float:
    return float((values * mask.to(values.dtype)).sum() / tokens)
