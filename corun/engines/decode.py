"""Batched sampling from a Hugging Face causal LM with its KV cache: what the
transformers rollout engine (transformers_engine.py) and a trainer's held-out
evaluation run, and the sampling math the trainers share with it (nucleus log-probs,
left padding, position ids that skip it).

Prompts of several lengths are left-padded; position ids skip the padding, so each
row computes what it would alone. Log-probs are under the full temperature-scaled
distribution (what the trainer recomputes; top-p only narrows what is drawn), and
each token records the weight version that produced it. With a ``sink`` (corun/contract/
engine.py's streaming rules) each step's tokens are handed over as they are drawn, a
row whose sink declines more is stopped there (masked like a finished row: the other
rows' draws are unchanged). When ``weights_version``
reports newer weights between two steps (a partial rollout), the cache of the old
weights is dropped and the prefix is re-read by the new ones. With
``Sampling.top_logprobs`` each step also keeps the most likely tokens under that same
distribution (a top-k of the row the behaviour log-prob is read from; nothing extra
otherwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from corun.contract.engine import Delta, Generation, Sampling, TokenSink
from corun.execution.compute import cancel_point


class CausalLM(Protocol):
    """A transformers causal LM (``AutoModelForCausalLM``) as ``model``, such as a
    trainer's policy (trainers/hf/policy.py's ``HFPolicy``)."""

    @property
    def model(self) -> nn.Module: ...


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids counting real tokens only (0 at each row's first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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


@torch.no_grad()
def generate(
    policy: CausalLM, prompts: Sequence[Sequence[int]], sampling: Sampling,
    generator: torch.Generator | None, pad_id: int,
    weights_version: Callable[[], int] = lambda: 0, sink: TokenSink | None = None,
) -> list[Generation]:  # fmt: skip
    """One continuation per prompt; ``temperature`` 0 is greedy and draws nothing.
    Computes on the model's device (``generator`` must be on it too); the results come
    back to the CPU once, at the end (and, with ``sink``, each step's tokens as well)."""
    model = policy.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    batch = ids.shape[0]
    stop_ids = sampling.stop_ids or (-1,)
    stops = torch.tensor(stop_ids, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens: list[Tensor] = []
    logprobs: list[Tensor] = []
    tops: list[tuple[Tensor, Tensor]] = []  # per step: (ids, log-probs), with top_logprobs
    versions: list[int] = []
    cache = None
    step_ids = ids  # what the next forward reads: the whole prefix, or the last token
    keep = {"logits_to_keep": 1} if _keeps_logits(model) else {}  # not the prefix's
    cut: dict[int, int] = {}  # rows a sink declined: the tokens they keep
    for step in range(sampling.max_tokens):
        if step:
            cancel_point()
        version = weights_version()
        if versions and version != versions[-1]:  # new weights: re-read the prefix
            cache, step_ids = None, ids
        versions.append(version)
        attention = mask.long()
        out = model(
            input_ids=step_ids, attention_mask=attention,
            position_ids=positions(attention)[:, -step_ids.shape[1] :],
            past_key_values=cache, use_cache=True, **keep,
        )  # fmt: skip
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        token, logprob, log_dist = _draw(logits, sampling, generator)
        if sampling.top_logprobs:
            best = log_dist.topk(min(sampling.top_logprobs, log_dist.shape[-1]), dim=-1)
            tops.append((best.indices, best.values))
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        logprobs.append(logprob.masked_fill(done, 0.0))
        if sink is not None:
            _hand_over(sink, done, tokens, logprobs, version, tops, cut)
        done |= torch.isin(token, stops)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=1)
        step_ids = token[:, None]
        if bool(done.all()):
            break
    model.train(was_training)
    return _generations(tokens, logprobs, versions, set(stop_ids), tops, cut)


def _hand_over(
    sink: TokenSink, done: Tensor, tokens: list[Tensor], logprobs: list[Tensor], version: int,
    tops: list[tuple[Tensor, Tensor]], cut: dict[int, int],
) -> None:  # fmt: skip
    """This step's token of each running row to ``sink``; a row it declines is marked
    done (in place) and keeps its tokens so far."""
    running = (~done).nonzero().flatten().tolist()
    if not running:
        return
    step_ids, step_lps = tokens[-1].tolist(), logprobs[-1].tolist()
    best = [(ids.tolist(), lps.tolist()) for ids, lps in tops[-1:]]
    for row in running:
        top = [list(zip(best[0][0][row], best[0][1][row], strict=True))] if best else None
        if not sink(row, Delta([step_ids[row]], [step_lps[row]], [version], top)):
            done[row] = True
            cut[row] = len(tokens)


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
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids, mask = left_pad([[*p, *c] for p, c in zip(prompts, completions, strict=True)],
                         pad_id, device)  # fmt: skip
    attention = mask.long()
    logits = model(input_ids=ids, attention_mask=attention,
                   position_ids=positions(attention)).logits[:, :-1].float()  # fmt: skip
    log_dist = torch.log_softmax(logits, dim=-1).cpu()
    model.train(was_training)
    # Left-padded: each completion is its row's last tokens, read from the position before.
    width = log_dist.shape[1]
    return [log_dist[i, width - len(c) :] for i, c in enumerate(completions)]


def _keeps_logits(model: nn.Module) -> bool:
    """Whether ``model`` computes only its last positions' logits when asked
    (transformers' ``logits_to_keep``; a peft wrapper passes it to its base model)."""
    unwrap = getattr(model, "get_base_model", None)
    base = unwrap() if callable(unwrap) else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _draw(
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


def _generations(
    tokens: list[Tensor], logprobs: list[Tensor], versions: list[int], stop_ids: set[int],
    tops: list[tuple[Tensor, Tensor]], cut: dict[int, int] | None = None,
) -> list[Generation]:  # fmt: skip
    if not tokens:
        return []
    out = []
    rows = zip(torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist(), strict=True)
    top_ids = torch.stack([ids for ids, _ in tops], 1).tolist() if tops else None
    top_lps = torch.stack([lps for _, lps in tops], 1).tolist() if tops else None
    for row, (ids, lps) in enumerate(rows):
        stop_at = next((i for i, token in enumerate(ids) if token in stop_ids), None)
        end = len(ids) if stop_at is None else stop_at + 1
        finish: Literal["stop", "length"] = "length" if stop_at is None else "stop"
        if cut and row in cut and cut[row] < end:  # declined by a sink before it ended
            end, finish = cut[row], "length"
        generation = Generation(ids[:end], lps[:end], versions[:end], finish)
        if top_ids is not None and top_lps is not None:
            generation.top = [
                list(zip(step_ids, step_lps, strict=True))
                for step_ids, step_lps in zip(top_ids[row][:end], top_lps[row][:end], strict=True)
            ]
        out.append(generation)
    return out
