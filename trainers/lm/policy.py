"""Pieces every TinyLM trainer shares: building the policy, warm-starting it from a
checkpoint, activation checkpointing, held-out greedy evaluation, and per-token
log-probs of responses (and the exact reverse KL to a teacher), computed a chunk of
positions at a time when the whole batch's logits would be too large."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol, TypeVar

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from corun.base.errors import CheckpointError
from corun.execution import parallel
from trainers.lm.engine import Rollouts
from trainers.lm.model import ModelConfig, TinyLM
from trainers.lm.tasks import EOS, MAX_LEN, VOCAB_SIZE, Task, decode_responses, encode_prompts
from trainers.weights import (
    load_optimizer_state,
    optimizer_state,
    rebuild,
    to_device,
    warm_start,
)


def build_policy(d_model: int, n_layers: int, n_heads: int) -> TinyLM:
    """A fresh TinyLM; its init draws from the global torch RNG (seeded by the runtime)."""
    config = ModelConfig(
        vocab_size=VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        max_len=MAX_LEN,
    )  # fmt: skip
    return TinyLM(config)


def load_policy(state: dict[str, Any], device: torch.device | str = "cpu") -> TinyLM:
    """Rebuild the TinyLM of a trainer ``state_dict()`` (``model_config`` + ``model``) on
    ``device``."""
    return rebuild(TinyLM, ModelConfig, state, device)


def policy_from(init_from: str) -> TinyLM:
    """Warm start: the policy in a checkpoint, given its directory or its run's config."""
    return warm_start(init_from, load_policy, "TinyLM policy")


L = TypeVar("L", bound=TinyLM)

# LMTrainerConfig.logits_chunk's default: 16M logits, 64 MiB in float32.
LOGITS_CHUNK = 1 << 24


def with_checkpointing(model: L, enabled: bool) -> L:
    """``model`` recomputing each block's activations in the backward pass instead of
    keeping them, when ``enabled`` (memory for compute; in place). Returns ``model``."""
    model.checkpointing = enabled
    return model


def sharded(model: L, strategy: parallel.Strategy) -> L:
    """``model`` spread over the torchrun ranks (FSDP2, a unit per block; nothing at
    world size 1). Before building its optimizer: sharding replaces the parameters."""
    parallel.parallelize(
        model, strategy=strategy, blocks=list(model.blocks), methods=("hidden", "head")
    )
    return model


def policy_state(
    model: TinyLM, optimizer: torch.optim.Optimizer, task: str,
    modules: Mapping[str, nn.Module] = {}, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A trainer's resumable state around a TinyLM (and ``modules`` its optimizer trains
    beside it): live tensors, so the runtime snapshots them before the next step
    changes them."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer_state(optimizer, {"policy": model, **modules}),
        "model_config": msgspec.structs.asdict(model.config),
        "task": task,
        **extra,
    }


def load_policy_state(
    state: dict[str, Any], model: TinyLM, optimizer: torch.optim.Optimizer, task: str,
    modules: Mapping[str, nn.Module] = {},
) -> None:  # fmt: skip
    """Restore :func:`policy_state`; a checkpoint of another shape or task is refused."""
    saved = state.get("model_config"), state.get("task")
    ours = msgspec.structs.asdict(model.config), task
    if saved != ours:
        raise CheckpointError(
            f"checkpoint is for model {saved[0]} on task {saved[1]!r}, "
            f"this run builds {ours[0]} on task {ours[1]!r}"
        )
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, {"policy": model, **modules}, state["optimizer"])


class HeldOutEval:
    """Greedy decoding on a task's held-out prompts: exact match and mean reward.

    Greedy decoding draws no random numbers, so evaluating never perturbs training.
    """

    def __init__(self, task: Task, size: int, device: torch.device | str = "cpu") -> None:
        self.task = task
        self.examples = task.eval_set(size)
        # Encoded on the CPU, moved once to ``device``: the evaluated model's.
        self.prompt_ids = to_device(encode_prompts([p for p, _ in self.examples]), device)

    @torch.no_grad()
    def __call__(self, model: TinyLM) -> dict[str, float]:
        was_training = model.training
        model.eval()
        with parallel.gathered(model):  # decoding enters the model past its hooks
            new_ids = model.generate(self.prompt_ids, self.task.max_answer_len + 1, stop_id=EOS)
        model.train(was_training)
        responses = decode_responses(new_ids)
        exact = reward = 0.0
        for (prompt, answer), response in zip(self.examples, responses, strict=True):
            exact += response == answer
            reward += self.task.reward(prompt, answer, response)
        return {"eval/accuracy": exact / len(responses), "eval/reward": reward / len(responses)}


class CausalPolicy(Protocol):
    """What the LM trainers need of a policy: TinyLM, or a Hugging Face causal LM
    (trainers/hf/policy.py)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """The head's output size: the logits' last dimension."""
        ...

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...


def response_logprobs(
    model: CausalPolicy, sequences: Tensor, prompt_len: int, temperature: float,
    attention_mask: Tensor | None = None, chunk: int = LOGITS_CHUNK,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Per-token log-probs and entropies of the response part of ``sequences`` → (logp,
    entropy, hidden), each over the response positions; the logits are divided by
    ``temperature`` first, as sampling at that temperature divides them.

    Pass the temperature the responses were sampled at: dividing as the sampler did
    makes the ratio to the behaviour log-probs 1 for unchanged weights (1.0: the
    model's own distribution; a temperature near 0 is floored at 1e-6).
    ``attention_mask`` marks the real tokens of left-padded prompts; ``hidden`` feeds a
    value head.

    ``chunk`` bounds the logits (positions x vocabulary entries) held at once: a batch
    with more is computed a few positions at a time (see :func:`in_chunks`); 0 or a
    batch within it computes all positions at once.
    """
    hidden = response_hidden(model, sequences, prompt_len, attention_mask)
    targets = sequences[:, prompt_len:]
    stats = partial(_token_stats, model.head, max(temperature, 1e-6))
    size = chunk_positions(targets.numel(), model.vocab_size, chunk)
    if size is None:  # one pass, as before chunks: the same numbers bit for bit
        logp, entropy = stats(hidden, targets)
    else:
        logp, entropy = in_chunks(stats, size, hidden, targets)
    return logp, entropy, hidden


def response_hidden(
    model: CausalPolicy, sequences: Tensor, prompt_len: int, attention_mask: Tensor | None = None
) -> Tensor:
    """The hidden states that predict the response part of ``sequences`` (rows, T, d):
    a value head's input, and the head's for :func:`response_logprobs`."""
    mask = None if attention_mask is None else attention_mask[:, :-1]
    return model.hidden(sequences[:, :-1], mask)[:, prompt_len - 1 :]


def rollout_hidden(model: CausalPolicy, rollouts: Rollouts) -> Tensor:
    """:func:`response_hidden` of a batch of rollouts: no logits computed."""
    return response_hidden(
        model, rollouts.sequences, rollouts.prompt_ids.shape[1], rollouts.attention_mask
    )


def rollout_logprobs(
    model: CausalPolicy, rollouts: Rollouts, temperature: float, chunk: int = LOGITS_CHUNK
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`response_logprobs` of a batch of rollouts."""
    return response_logprobs(
        model, rollouts.sequences, rollouts.prompt_ids.shape[1], temperature,
        rollouts.attention_mask, chunk,
    )  # fmt: skip


def exact_reverse_kl(
    model: CausalPolicy, hidden: Tensor, teacher_rows: Tensor, temperature: float,
    chunk: int = LOGITS_CHUNK,
) -> Tensor:  # fmt: skip
    """KL(student ‖ teacher) at each position of ``hidden`` (rows, T, d), exactly over
    the vocabulary: Σ_v S(v)·(log S(v) − T(v)), S the student's distribution at
    ``temperature`` (in float32), ``teacher_rows`` (rows, T, vocab) the teacher's
    log-probs. Returns (rows, T); ``chunk`` as in :func:`response_logprobs`."""
    kl = partial(_reverse_kl, model.head, max(temperature, 1e-6))
    size = chunk_positions(hidden.shape[:-1].numel(), teacher_rows.shape[-1], chunk)
    if size is None:
        return kl(hidden, teacher_rows)[0]
    return in_chunks(kl, size, hidden, teacher_rows)[0]


def target_logprobs(
    model: CausalPolicy, hidden: Tensor, targets: Tensor, chunk: int = LOGITS_CHUNK
) -> Tensor:
    """Each ``targets`` token's log-prob (temperature 1) from ``hidden`` (rows, T, d), as
    teacher forcing reads them; ``chunk`` as in :func:`response_logprobs`."""
    size = chunk_positions(targets.numel(), model.vocab_size, chunk)
    if size is None:
        return _target_logp(model.head, hidden, targets)[0]
    return in_chunks(partial(_target_logp, model.head), size, hidden, targets)[0]


def chunk_positions(positions: int, vocab: int, chunk: int) -> int | None:
    """How many positions one pass of at most ``chunk`` logits takes (at least 1);
    None when all ``positions`` fit (or ``chunk`` is 0): one pass, no chunks."""
    if chunk == 0 or positions * vocab <= chunk:
        return None
    return max(1, chunk // vocab)


def in_chunks(
    fn: Callable[..., tuple[Tensor, ...]], size: int, *inputs: Tensor
) -> tuple[Tensor, ...]:
    """``fn`` over the (rows, T) leading positions of ``inputs``, ``size`` flattened
    positions at a time; returns its outputs (a value per position) as (rows, T).

    With gradients on, each chunk is checkpointed: autograd keeps only the chunk's
    inputs, and backward recomputes its logits, so no pass, forward or backward, holds
    more than one chunk's.
    """
    shape = inputs[0].shape[:2]
    flat = [x.reshape(shape.numel(), *x.shape[2:]) for x in inputs]
    parts: list[tuple[Tensor, ...]] = []
    for start in range(0, shape.numel(), size):
        args = [x[start : start + size] for x in flat]
        if torch.is_grad_enabled():
            parts.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            parts.append(fn(*args))
    return tuple(torch.cat(outputs).view(shape) for outputs in zip(*parts, strict=True))


def _token_stats(
    head: Callable[[Tensor], Tensor], temperature: float, hidden: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    """The log-prob of each ``targets`` token and the entropy at each position."""
    logits = head(hidden) / temperature
    log_dist = F.log_softmax(logits, dim=-1)
    logp = log_dist.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(log_dist.exp() * log_dist).sum(dim=-1)
    return logp, entropy


def _target_logp(
    head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor
) -> tuple[Tensor]:
    log_dist = F.log_softmax(head(hidden), dim=-1)
    return (log_dist.gather(-1, targets[..., None]).squeeze(-1),)


def _reverse_kl(
    head: Callable[[Tensor], Tensor], temperature: float, hidden: Tensor, teacher: Tensor
) -> tuple[Tensor]:
    logits = head(hidden) / temperature
    # float32 at least, whatever the compute precision (float64 stays float64)
    student = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return ((student.exp() * (student - teacher)).sum(dim=-1),)
