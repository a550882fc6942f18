"""Pieces every TinyLM trainer shares: building the policy, warm-starting it from a
checkpoint, held-out greedy evaluation, and per-token log-probs of responses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

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

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...


def response_logprobs(
    model: CausalPolicy, sequences: Tensor, prompt_len: int, temperature: float,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Per-token log-probs and entropies of the response part of ``sequences``.

    Logits are divided by ``temperature``, as when sampling, so the ratio to the
    behaviour log-probs is 1 for unchanged weights. ``attention_mask`` marks the real
    tokens of left-padded prompts. Returns (logp, entropy, hidden) over the T response
    positions; ``hidden`` feeds a value head.
    """
    inputs = sequences[:, :-1]
    mask = None if attention_mask is None else attention_mask[:, :-1]
    hidden = model.hidden(inputs, mask)[:, prompt_len - 1 :]
    logits = model.head(hidden) / max(temperature, 1e-6)
    log_dist = F.log_softmax(logits, dim=-1)
    targets = sequences[:, prompt_len:]
    logp = log_dist.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(log_dist.exp() * log_dist).sum(dim=-1)
    return logp, entropy, hidden


def rollout_logprobs(
    model: CausalPolicy, rollouts: Rollouts, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`response_logprobs` of a batch of rollouts."""
    return response_logprobs(
        model, rollouts.sequences, rollouts.prompt_ids.shape[1], temperature,
        rollouts.attention_mask,
    )  # fmt: skip
