"""Continuous batching for a Hugging Face causal LM: generation calls join one running
batch between two decode steps and leave it when their rows end, so a call started
during a long one gets its first token within a step instead of after that call.

A :class:`RunningBatch` holds the running calls' rows left-padded to one width, with
their KV cache. :meth:`RunningBatch.step` runs one decode step of all of them (a
blocking call), :meth:`RunningBatch.steps` runs steps until one of them finishes. A call
admitted at a step is read whole in a pass of its own, and its cache joins the
batch's, the narrower side padded on the left (masked, as left padding is). A call
keeps its rows in the batch until all of them end, each step drawing for all of them
from the call's own generator, so a call alone computes what a generation computed
before continuous batching: the same forward passes and the same draws. Beside other
calls its rows are read in a wider batch, which can round a matmul differently (as in
vLLM).

When ``weights_version`` reports newer weights between two steps (a partial rollout),
the cache of the old weights is dropped and every row's prefix is re-read by the new
ones. A cache this module cannot pad or cut (not transformers' plain dynamic cache) is
dropped at a join or a leave the same way: slower, not different.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from corun.contract.engine import Delta, Generation, Sampling, TokenSink
from corun.engines.decode import (
    CausalLM,
    draw,
    evaluating,
    keeps_logits,
    left_pad,
    positions,
)
from corun.execution.compute import cancel_point, stop_requested


@dataclass(eq=False)
class Call:
    """One generation call: a continuation of each prompt, drawn with ``generator``."""

    prompts: list[list[int]]
    sampling: Sampling
    generator: torch.Generator | None
    sink: TokenSink | None = None
    left: bool = False  # its caller went away: its rows leave the batch at the next step
    result: list[Generation] | None = None
    error: BaseException | None = None
    tokens: list[Tensor] = field(default_factory=list)  # per step, one per row
    logprobs: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # with top_logprobs
    cut: dict[int, int] = field(default_factory=dict)  # rows a sink declined: tokens kept
    done: Tensor | None = None  # rows that ended
    stops: Tensor | None = None  # the stop ids, on the rows' device

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def over(self) -> bool:
        """Answered, or failed."""
        return self.result is not None or self.error is not None

    def empty(self) -> bool:
        """Nothing to generate: answered at once (no prompts, or no tokens asked for)."""
        if self.prompts and self.sampling.max_tokens > 0:
            return False
        self.result = []
        return True

    def take(self, logits: Tensor, version: int, pad_id: int) -> Tensor:
        """Draw this step's token of each row from its ``logits``; keep it (and hand it
        to the sink); return the tokens (a row that ended gets ``pad_id``)."""
        if self.done is None:
            self.done = torch.zeros(self.rows, dtype=torch.bool, device=logits.device)
            self.stops = torch.tensor(self.sampling.stop_ids or (-1,), device=logits.device)
        token, logprob, log_dist = draw(logits, self.sampling, self.generator)
        if self.sampling.top_logprobs:
            best = log_dist.topk(min(self.sampling.top_logprobs, log_dist.shape[-1]), dim=-1)
            self.tops.append((best.indices, best.values))
        token = token.masked_fill(self.done, pad_id)
        self.tokens.append(token)
        self.logprobs.append(logprob.masked_fill(self.done, 0.0))
        self.versions.append(version)
        if self.sink is not None:
            _hand_over(self.sink, self.done, self.tokens, self.logprobs, version, self.tops,
                      self.cut)  # fmt: skip
        assert self.stops is not None
        self.done |= torch.isin(token, self.stops)
        return token

    def finish(self) -> bool:
        """Whether every row has ended (then :attr:`result` holds the generations)."""
        assert self.done is not None
        if len(self.tokens) < self.sampling.max_tokens and not bool(self.done.all()):
            return False
        stop_ids = set(self.sampling.stop_ids or (-1,))
        self.result = _generations(self.tokens, self.logprobs, self.versions, stop_ids,
                                  self.tops, self.cut)  # fmt: skip
        return True


class RunningBatch:
    """The rows of the running calls of ``model`` and their KV cache; at most
    ``max_rows`` rows at once (a call larger than that runs alone)."""

    def __init__(self, model: nn.Module, pad_id: int, max_rows: int | None = None) -> None:
        self.model = model
        self.pad_id = pad_id
        self.max_rows = max_rows
        self.device = next(model.parameters()).device
        self._keep = {"logits_to_keep": 1} if keeps_logits(model) else {}  # not the prefix's
        # Appended on the event loop, taken at a step on the lane's thread (a deque's
        # append and popleft are atomic).
        self.waiting: deque[Call] = deque()
        self.calls: list[Call] = []  # running, their rows in this order
        # The rows' tokens so far, left-padded, and which of them are real.
        self.ids = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self.mask = torch.empty(0, 0, dtype=torch.bool, device=self.device)
        self.cache: Any = None  # of every column but the last (None: none is cached)
        self.version: int | None = None  # of the weights that computed the cache

    def submit(self, call: Call) -> None:
        """Run ``call`` from the next step on (a step admits calls in the order given)."""
        self.waiting.append(call)

    @property
    def idle(self) -> bool:
        """No call is running or waiting (but those whose callers left)."""
        return all(c.left for c in self.calls) and all(c.left for c in self.waiting)

    def reset(self, error: BaseException | None = None) -> list[Call]:
        """Forget every call (failing them with ``error`` if given) and the cache; returns
        the calls that were running or waiting."""
        dropped = [*self.calls, *self.waiting]
        self.waiting.clear()
        self._no_rows()
        for call in dropped:
            if error is not None and not call.over:
                call.error = error
        return dropped

    def _no_rows(self) -> None:
        self.calls = []
        self.ids, self.mask, self.cache = self.ids[:0, :0], self.mask[:0, :0], None

    @torch.no_grad()
    def step(self, weights_version: Callable[[], int] = lambda: 0) -> list[Call]:
        """One decode step of every running call, after admitting those waiting that fit;
        returns the calls it finished (their :attr:`Call.result` set)."""
        self._remove([c for c in self.calls if c.left])
        version = weights_version()
        if version != self.version:  # new weights: every prefix is re-read by them
            self.cache, self.version = None, version
        admitted = self._admit()
        if not self.calls and not admitted:
            return []
        with evaluating(self.model):
            logits = self._forward(admitted)
        self.calls += admitted
        column, start = [], 0
        for call in self.calls:
            column.append(call.take(logits[start : start + call.rows], version, self.pad_id))
            start += call.rows
        real = torch.ones(len(self.ids), 1, dtype=torch.bool, device=self.device)
        drawn = column[0] if len(column) == 1 else torch.cat(column)
        self.ids = torch.cat([self.ids, drawn[:, None]], dim=1)
        self.mask = torch.cat([self.mask, real], dim=1)
        finished = [call for call in self.calls if call.finish()]
        self._remove(finished)
        return finished

    def steps(self, weights_version: Callable[[], int] = lambda: 0) -> list[Call]:
        """:meth:`step` until one finishes a call, no call is left to step, or (in a
        lane call) the caller is cancelled: the calls finished. Calls submitted
        meanwhile join at the next step, so one blocking call serves them all until a
        result must go back (a lane call per step costs ~15 % on the tiny model)."""
        with evaluating(self.model):
            while True:
                finished = self.step(weights_version)
                if finished or self.idle or stop_requested():
                    return finished

    def _admit(self) -> list[Call]:
        rows = sum(call.rows for call in self.calls)
        admitted: list[Call] = []
        while self.waiting:
            call = self.waiting[0]
            fits = self.max_rows is None or rows + call.rows <= self.max_rows
            if not call.left and not fits and (rows or admitted):
                break  # in order: it waits for rows to free, and those after it too
            self.waiting.popleft()
            if not call.left:
                admitted.append(call)
                rows += call.rows
        return admitted

    def _forward(self, admitted: list[Call]) -> Tensor:
        """This step's last-position logits of the running rows, then the admitted ones',
        whose rows and cache join the batch."""
        logits = []
        if self.calls:
            read = self.ids if self.cache is None else self.ids[:, -1:]
            out = self._read(read, self.mask, self.cache)
            self.cache = out.past_key_values
            logits.append(out.logits[:, -1].float())
        if admitted:
            ids, mask = left_pad([p for call in admitted for p in call.prompts], self.pad_id,
                                 self.device)  # fmt: skip
            out = self._read(ids, mask, None)
            logits.append(out.logits[:, -1].float())
            if self.calls:
                self._join(ids, mask, out.past_key_values)
            else:
                self.ids, self.mask, self.cache = ids, mask, out.past_key_values
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def _read(self, ids: Tensor, mask: Tensor, cache: Any) -> Any:
        attention = mask.long()
        return self.model(
            input_ids=ids, attention_mask=attention,
            position_ids=positions(attention)[:, -ids.shape[1] :],
            past_key_values=cache, use_cache=True, **self._keep,
        )  # fmt: skip

    def _join(self, ids: Tensor, mask: Tensor, cache: Any) -> None:
        """Rows read in a pass of their own, under the running ones."""
        width = max(self.ids.shape[1], ids.shape[1])
        own, new = _layers(self.cache), _layers(cache)
        if own is None or new is None:
            self.cache = None
        else:
            for mine, theirs in zip(own, new, strict=True):
                mine.keys = torch.cat([_pad_left(mine.keys, width, 2),
                                       _pad_left(theirs.keys, width, 2)])  # fmt: skip
                mine.values = torch.cat([_pad_left(mine.values, width, 2),
                                         _pad_left(theirs.values, width, 2)])  # fmt: skip
        self.ids = torch.cat([_pad_left(self.ids, width, 1, self.pad_id),
                              _pad_left(ids, width, 1, self.pad_id)])  # fmt: skip
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])

    def _remove(self, calls: Sequence[Call]) -> None:
        """Take ``calls``' rows out, and the columns no row left needs."""
        if not calls:
            return
        gone = {id(call) for call in calls}
        keep: list[int] = []
        start = 0
        for call in self.calls:
            if id(call) not in gone:
                keep += range(start, start + call.rows)
            start += call.rows
        self.calls = [call for call in self.calls if id(call) not in gone]
        if not keep:
            self._no_rows()
            return
        index = torch.tensor(keep, device=self.device)
        first = int(self.mask[index].any(dim=0).nonzero()[0])  # the first column in use
        self.ids, self.mask = self.ids[index, first:], self.mask[index, first:]
        layers = _layers(self.cache)
        if layers is None:
            self.cache = None
            return
        for layer in layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]


@torch.no_grad()
def generate(
    policy: CausalLM, prompts: Sequence[Sequence[int]], sampling: Sampling,
    generator: torch.Generator | None, pad_id: int,
    weights_version: Callable[[], int] = lambda: 0, sink: TokenSink | None = None,
) -> list[Generation]:  # fmt: skip
    """One continuation per prompt, as one call alone in a batch (blocking; a lane call
    stops between two steps when its caller is cancelled). ``temperature`` 0 is greedy
    and draws nothing. Computes on the model's device (``generator`` must be on it too);
    the results come back to the CPU once, at the end (and, with ``sink``, each step's
    tokens as well: corun/contract/engine.py's streaming rules)."""
    call = Call([list(p) for p in prompts], sampling, generator, sink)
    if call.empty():
        return []
    batch = RunningBatch(policy.model, pad_id)
    batch.submit(call)
    with evaluating(policy.model):
        while not call.over:
            if call.tokens:
                cancel_point()
            batch.step(weights_version)
    assert call.result is not None
    return call.result


def _layers(cache: Any) -> list[Any] | None:
    """The per-layer key and value holders of transformers' dynamic cache, or None for
    another kind (a sliding window, a recurrent state: not padded or cut here)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or not all(type(layer) is DynamicLayer for layer in layers):
        return None
    return list(layers)


def _pad_left(tensor: Tensor, width: int, dim: int, value: int | bool = 0) -> Tensor:
    """``tensor`` widened to ``width`` along ``dim`` by ``value`` on the left."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.full(shape, value, dtype=tensor.dtype, device=tensor.device),
                      tensor], dim=dim)  # fmt: skip


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
