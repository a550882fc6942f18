"""The sampling math of a Hugging Face causal LM, shared by the transformers rollout
engine's generation (continuous.py), a trainer's held-out evaluation and the trainers
themselves: left padding and position ids that skip it (so each row computes what it
would alone), one draw per row with its log-prob under the full temperature-scaled
distribution (what the trainer recomputes; top-p and top-k only narrow what is drawn),
and scoring passes over prompts and their completions.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from corun.contract.engine import Sampling


class CausalLM(Protocol):
    """A transformers causal LM (``AutoModelForCausalLM``) as ``model``, such as a
    trainer's policy (trainers/hf/policy.py's ``HFPolicy``)."""

    @property
    def model(self) -> nn.Module: ...


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only (0 at each row's first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode within (a trainer's policy is put back in training mode
    after; switching walks every module, so it is done once for many steps)."""
    if not model.training:
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train()


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Rows of ids left-padded to one length: (ids, mask of real tokens), made on
    ``device`` (default: the CPU, where a batch of rollouts is built) in one copy each."""
    width = max(len(row) for row in rows)
    padded = [[pad_id] * (width - len(row)) + list(row) for row in rows]
    real = [[False] * (width - len(row)) + [True] * len(row) for row in rows]
    ids = torch.tensor(padded, dtype=torch.long, device=device)
    return ids, torch.tensor(real, dtype=torch.bool, device=device)


def top_k_logits(logits: Tensor, k: int) -> Tensor:
    """``logits`` with all but each row's ``k`` largest at -inf."""
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_log_probs(logits: Tensor, top_p: float) -> Tensor:
    """Log-probs over the smallest set of tokens whose mass reaches ``top_p`` (-inf elsewhere)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    if top_p >= 1.0:
        return log_probs
    sorted_lp, order = log_probs.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    sorted_lp = sorted_lp.masked_fill(mass_before >= top_p, float("-inf"))
    kept = torch.full_like(log_probs, float("-inf")).scatter(-1, order, sorted_lp)
    return torch.log_softmax(kept, dim=-1)


# The most logits (positions x vocabulary entries) a scoring pass holds, beyond one
# row's: what a trainer's log-prob passes hold (trainer.logits_chunk's default).
SCORE_LOGITS = 1 << 24


def score(
    policy: CausalLM, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
    pad_id: int,
) -> list[list[float]]:  # fmt: skip
    """Per completion, each token's log-prob (temperature 1) given its prompt and the
    completion's tokens before it; a few rows a pass, so that no pass holds more than
    :data:`SCORE_LOGITS` logits unless one row does."""
    width = max((len(p) + len(c) for p, c in zip(prompts, completions, strict=True)), default=1)
    config: Any = policy.model.config
    vocab = int(config.vocab_size)
    rows_per_pass = max(1, SCORE_LOGITS // max(1, width * vocab))
    scores = []
    for start in range(0, len(prompts), rows_per_pass):
        part = slice(start, start + rows_per_pass)
        rows = distributions(policy, prompts[part], completions[part], pad_id)
        scores += [row.gather(-1, torch.tensor(c, dtype=torch.long)[:, None])[:, 0].tolist()
                   for row, c in zip(rows, completions[part], strict=True)]  # fmt: skip
    return scores


@torch.no_grad()
def distributions(
    policy: CausalLM, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
    pad_id: int,
) -> list[Tensor]:  # fmt: skip
    """Per completion, the model's whole log-prob row (temperature 1) at each of its
    tokens, given its prompt and the completion's tokens before it: (tokens, vocab),
    on the CPU. One forward pass over the rows, left-padded."""
    model = policy.model
    device = next(model.parameters()).device
    ids, mask = left_pad([[*p, *c] for p, c in zip(prompts, completions, strict=True)],
                         pad_id, device)  # fmt: skip
    attention = mask.long()
    with evaluating(model):
        logits = model(input_ids=ids, attention_mask=attention,
                       position_ids=positions(attention)).logits[:, :-1].float()  # fmt: skip
    log_dist = torch.log_softmax(logits, dim=-1).cpu()
    # Left-padded: each completion is its row's last tokens, read from the position before.
    width = log_dist.shape[1]
    return [log_dist[i, width - len(c) :] for i, c in enumerate(completions)]


def keeps_logits(model: nn.Module) -> bool:
    """Whether ``model`` computes only its last positions' logits when asked
    (transformers' ``logits_to_keep``; a peft wrapper passes it to its base model)."""
    unwrap = getattr(model, "get_base_model", None)
    base = unwrap() if callable(unwrap) else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def draw(
    logits: Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, their log-probs, the log-distribution those are read from)."""
    if sampling.temperature <= 0:
        log_dist = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        log_dist = torch.log_softmax(scaled, dim=-1)
        kept = scaled if not sampling.top_k else top_k_logits(scaled, sampling.top_k)
        if sampling.top_p < 1.0:
            nucleus = top_p_log_probs(kept, sampling.top_p)
        else:
            nucleus = log_dist if kept is scaled else torch.log_softmax(kept, dim=-1)
        token = sample_rows(nucleus.exp(), generator)
    return token, log_dist.gather(1, token[:, None]).squeeze(1), log_dist


def sample_rows(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs`` (each row's weights, summing to about 1), by its
    inverse CDF: the first token whose cumulative weight passes a uniform draw. Each
    token has its weight's chance, and one of weight 0 is never drawn (its cumulative
    weight equals the one before it). ``torch.multinomial`` draws the same law ~15x
    slower on a CPU (1 ms for 128 rows of 400 tokens: a sixth of a step's decoding on
    the built-in tiny model)."""
    cumulative = probs.cumsum(dim=-1)
    drawn = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    token = torch.searchsorted(cumulative, drawn * cumulative[:, -1:], right=True)
    return token.squeeze(1).clamp_(max=probs.shape[-1] - 1)
