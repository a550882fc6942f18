"""What a trainer implements so that a client drives training step by step (the Tinker
API, served by corun/serve/tinker/): models created on request — LoRA adapters over a
base model the trainer serves — trained by forward-backward passes under a named loss
and optimizer steps the client sets, sampled, and saved or loaded as corun checkpoints.

The server owns the protocol (sessions, futures, the order of requests per model); the
trainer owns the compute. Every method of :class:`TrainingModel` blocks and runs on a
compute lane; the server calls one model's methods in the client's order, never two at
once. Refusals are :class:`RequestError`: the client's mistake, answered as the SDK's
``user`` error category with the message as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from torch import Tensor

from corun.contract.engine import Generation, Sampling

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
LOSSES: tuple[LossName, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# What each loss reads from a datum's inputs, beside the model's input tokens.
LOSS_INPUTS: dict[LossName, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}


class RequestError(ValueError):
    """A request that cannot be served as sent (shapes, names, ids): the client's error."""


@dataclass(frozen=True)
class LoraShape:
    """The adapters a client asks for: rank, and which weights they adapt."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class Datum:
    """One sequence: the model's input tokens and the loss's inputs, one entry per input
    position (``target_tokens[i]`` is the token the model should predict after
    ``tokens[: i + 1]``)."""

    tokens: list[int]
    inputs: Mapping[str, Tensor]


@dataclass(frozen=True)
class AdamStep:
    """One AdamW step with the client's hyper-parameters (``grad_clip_norm`` 0: none)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class ForwardResult:
    """Per datum, the loss's outputs (``logprobs`` of the targets, ``elementwise_loss``),
    and metrics over the batch (``loss:sum``)."""

    outputs: list[dict[str, Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    base_model: str
    lora_rank: int
    tokenizer: str  # what the client loads the tokenizer from (a local directory)
    max_length: int  # the longest sequence the model takes


class PromptScores(NamedTuple):
    """A prompt scored from its second token on: each token's log-prob after the ones
    before it, and (asked for) each position's most likely (token, log-prob), best first."""

    chosen: list[float]
    top: list[list[tuple[int, float]]]  # [] when no top-k was asked for


class TrainingModel(Protocol):
    """One client's model: base weights, frozen, and trained adapters with their AdamW
    state. Gradients add up over forward-backward calls until :meth:`optim_step`."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        ...

    def forward_backward(
        self, data: Sequence[Datum], loss: LossName, loss_config: Mapping[str, float],
        backward: bool,
    ) -> ForwardResult:  # fmt: skip
        """The loss (summed over tokens and data) and, with ``backward``, its gradient
        added to the adapters' (a forward pass only otherwise)."""
        ...

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """Apply and clear the gradients; returns metrics (``grad_norm``)."""
        ...

    @property
    def holds_gradients(self) -> bool:
        """Whether ``forward_backward`` added gradients no ``optim_step`` applied yet."""
        ...

    def save(self, path: Path, *, optimizer: bool) -> None:
        """Write the adapters (and the optimizer state) as a corun checkpoint at ``path``."""
        ...

    def load(self, path: Path, *, optimizer: bool) -> None:
        """Restore :meth:`save`'s checkpoint (a :class:`RequestError` if it is another
        model's, or damaged)."""
        ...


class TrainingBackend(Protocol):
    """The models a trainer serves to a training-API client."""

    def base_models(self) -> list[str]:
        """The names a client may ask for (the first is the canonical one)."""
        ...

    def create_model(self, base_model: str, lora: LoraShape, seed: int) -> TrainingModel:
        """A new model of ``base_model`` with fresh adapters drawn from ``seed``."""
        ...

    @property
    def max_length(self) -> int:
        """The longest sequence (prompt and sample) the base model takes."""
        ...

    async def sample(
        self, weights: Path | None, prompts: Sequence[Sequence[int]], sampling: Sampling,
        seed: int, *, stop_strings: Sequence[str] = (), stop_at_eos: bool = True,
    ) -> list[Generation]:  # fmt: skip
        """One continuation per prompt from the base model (``weights`` None) or from
        the adapters saved at ``weights`` (a :meth:`TrainingModel.save` checkpoint),
        ending at the model's end-of-sequence token (unless not ``stop_at_eos``), at a
        token of ``sampling.stop_ids``, or through the first of ``stop_strings`` (the
        tokens that complete it are kept)."""
        ...

    def prompt_logprobs(
        self, weights: Path | None, prompt: Sequence[int], top_k: int = 0
    ) -> PromptScores:
        """The log-prob of each prompt token after the ones before it (from the second
        token on), and with ``top_k`` each of those positions' most likely tokens, under
        the base model or the adapters saved at ``weights``; blocking (the server runs
        it on its lane)."""
        ...

    async def close(self) -> None:
        """Stop the sampling engines and release the models (a teardown step)."""
        ...
