"""The update protocol: from a trainer's ``loss`` to applied optimizer steps.

One owner for what every gradient trainer would otherwise write again:

- a **window** of ``loop.accumulate`` rollout batches makes one update; each batch's
  gradients are scaled by 1/window and add up; the optimizers step at the window's end;
- a window's update is ``loop.mini_batches`` optimizer steps, step ``j`` on mini-batch
  ``j`` of every batch of the window (PPO-style epochs over disjoint slices);
- a mini-batch may be split into the trainer's ``micro_batches(batch)`` pieces,
  backpropagated one at a time into the same gradients (memory), with cancel points
  between them;
- for a trainer that reports its rows' lengths (``row_tokens``), each such piece is
  further split into chunks of rows under the token budget ``loop.micro_batch_tokens``
  (and ``loop.micro_batch_rows``): rows grouped by length, each chunk cut to its own
  longest row (corun/loop/micro_batches.py); each chunk's loss is its share of the
  piece's, so the gradients are the unsplit piece's;
- before each step every registered optimizer's gradients are clipped to its
  ``grad_clip`` (global norm), and its rate set by ``loop.lr_schedule`` for the
  update's number (corun/loop/schedule.py; ``train/lr`` when not constant);
- under torchrun (world size > 1) each rank backpropagates its shard of the batch and
  the gradients are averaged over the ranks before clipping (DDP's semantics): by
  FSDP2 in backward for a model ``parallelize``d (corun/execution/parallel.py; its
  norm is the global one over every shard), by one flattened all-reduce per step for
  plain parameters (corun/execution/distributed.py); the step's metrics are averaged
  over the ranks, so every rank applies the same update and logs the same values.

Work happens as early as the weights allow: mini-batch 0 of a batch is backpropagated
when the batch arrives (its weights are the window's start), the window's other
mini-batches after the step before them. So without mini-batches nothing waits for
the window's end but the step itself. The **policy version** counts updates: it
advances once per window, however many optimizer steps the window takes.

Metrics of one ``train`` call (one rollout batch; at a window's end, the window's
later mini-batches too): ``train/loss`` is the mean over the mini-batches computed of
their micro-batch losses' sum; every other value a ``loss`` returns is averaged over
the micro-batches that returned it (a micro-batch's chunks' values added up first:
each is its share); ``train/grad_norm`` (``train/<name>/grad_norm`` for an
optimizer registered under a name) is the mean norm before clipping over the steps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corun.base.config import Config
from corun.base.errors import ConfigError
from corun.base.rng import update_generator
from corun.contract.trainer import DEFAULT_OPTIMIZER, Batch, OptimizerSpec, Part, Trainer, overrides
from corun.execution import distributed, parallel
from corun.execution.compute import cancel_point
from corun.loop.flops import FlopMeter
from corun.loop.micro_batches import Chunks, agree_counts, plan_chunks, split_to
from corun.loop.schedule import ScheduleName, apply_factor, horizon, lr_factor


class Updater:
    """Turns one rollout batch at a time into gradients and, at window ends, steps."""

    def __init__(
        self, trainer: Trainer[Any], optimizers: Sequence[OptimizerSpec], *, window: int,
        mini_batches: int, seed: int, schedule: ScheduleName = "constant", updates: int = 1,
        warmup: int = 0, final: float = 0.0, micro_batch_tokens: int = 0,
        micro_batch_rows: int = 0,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.optimizers = list(optimizers)
        self.window = window
        self.mini_batches = mini_batches
        self.seed = seed
        self.schedule, self.updates, self.warmup, self.final = schedule, updates, warmup, final
        self.prepares = overrides(trainer, "prepare")
        self.budget = micro_batch_tokens, micro_batch_rows
        self.measures_rows = overrides(trainer, "row_tokens")
        self.splits = self.measures_rows and any(self.budget)
        # perf/mfu counts tokens: for a trainer that reports its rows' lengths
        params = (p for spec in self.optimizers for p in spec.params)
        self.flops = FlopMeter(trainer, params) if self.measures_rows else None
        self._tokens = 0.0  # this call's tokens computed (perf/mfu)
        self.world = distributed.world()
        self.version = 0  # of the weights the current window's update starts from
        # The window's batches so far, with their update generators and chunk plans:
        # mini-batches after the first revisit them once the step before has been applied.
        self._pending: list[tuple[Batch, torch.Generator, Pending]] = []

    @classmethod
    def of(
        cls, trainer: Trainer[Any], optimizers: Sequence[OptimizerSpec], config: Config
    ) -> Updater | None:
        """The protocol around ``trainer``'s loss; None for a trainer that owns
        ``train_step`` (or has no loss)."""
        loop = config.loop
        if overrides(trainer, "train_step") or not overrides(trainer, "loss"):
            if loop.lr_schedule != "constant":
                raise ConfigError(
                    f"`$.loop.lr_schedule` = {loop.lr_schedule!r}: {type(trainer).__name__} "
                    "steps its own optimizers (train_step), so the runtime cannot schedule them"
                )
            return None
        if not optimizers:
            raise TypeError(
                f"{type(trainer).__name__} defines a loss but registers no optimizer "
                "(ctx.add_optimizer in setup)"
            )
        return cls(
            trainer, optimizers, window=loop.accumulate, mini_batches=loop.mini_batches,
            seed=config.run.seed, schedule=loop.lr_schedule,
            updates=max(1, horizon(config)), warmup=loop.lr_warmup,
            final=loop.lr_final, micro_batch_tokens=loop.micro_batch_tokens,
            micro_batch_rows=loop.micro_batch_rows,
        )  # fmt: skip

    def train(self, batch: Batch, window_pos: int, version: int = 0) -> dict[str, float]:
        """Backpropagate ``batch`` (the ``window_pos``-th of its window, whose update
        starts from policy ``version``) and, if it ends the window, apply the update.
        Blocking: runs on the train lane."""
        self.version = version
        if self.flops is None:
            return self._train_on_ranks(batch, window_pos)
        self._tokens = 0.0
        device = self.optimizers[0].params[0].device
        metrics, mfu = self.flops.measure(
            lambda: self._train_on_ranks(batch, window_pos), lambda: self._tokens, device
        )
        if mfu is not None:
            metrics["perf/mfu"] = mfu
        return metrics

    def _train_on_ranks(self, batch: Batch, window_pos: int) -> dict[str, float]:
        if not self.world.parallel:
            return self._train(batch, window_pos)
        with distributed.collective_failures("the update's collectives"):
            return self._train(batch, window_pos)

    def _train(self, batch: Batch, window_pos: int) -> dict[str, float]:
        if window_pos == 0:
            self._zero_grad()
            self._pending.clear()
        lengths = self.trainer.row_tokens(batch) if self.measures_rows else None
        plans = self._plan(batch, lengths)
        batch.split = bool(plans)
        if self.prepares:
            batch.data = self.trainer.prepare(batch)
        generator, pending = update_generator(self.seed, batch.index), Pending(plans, lengths)
        self._pending.append((batch, generator, pending))
        sums = _MetricSums()
        # Nothing is applied yet: a stop here leaves the weights as they were.
        self._backward(batch, 0, generator, pending, sums, cancellable=True)
        if window_pos == self.window - 1:
            self._step(sums)
            with distributed.uncancellable():  # a step has been applied
                for mini in range(1, self.mini_batches):
                    self._zero_grad()
                    for earlier, earlier_generator, plan in self._pending:
                        self._backward(earlier, mini, earlier_generator, plan, sums, False)
                    self._step(sums)
            self._pending.clear()
        if not self.world.parallel:
            return sums.means()
        with distributed.uncancellable():
            batch.metrics = distributed.mean_metrics(batch.metrics)
            means = distributed.mean_metrics(sums.means())
        return {**means, "perf/collective_time_s": distributed.take_collective_s()}

    def _plan(self, batch: Batch, lengths: Sequence[int] | None) -> Plans:
        """The token budget's chunks of each (mini-batch, micro-batch) of ``batch`` (whose
        rows cost ``lengths``) that does not fit whole; agreed over the ranks
        (corun/loop/micro_batches.py)."""
        if not self.splits or lengths is None:
            return {}
        micros = self.trainer.micro_batches(batch)
        parts = [(mini, micro) for mini in range(self.mini_batches) for micro in range(micros)]
        # A part's rows: its micro-batch's, or the mini-batch's when micro-batches are
        # not row slices (Trainer.row_micro_batches).
        by_rows = self.trainer.row_micro_batches
        bounds = {
            (mini, micro): Part(
                mini, self.mini_batches, micro if by_rows else 0, micros if by_rows else 1
            ).micro_bounds(len(lengths))
            for mini, micro in parts
        }
        local = {key: plan_chunks(lengths, *bounds[key], *self.budget) for key in parts}
        counts = agree_counts([len(local[key] or [None]) for key in parts])
        plans: Plans = {}
        for key, count in zip(parts, counts, strict=True):
            if count > 1:
                whole = [torch.arange(*bounds[key], dtype=torch.long)]
                plans[key] = split_to(local[key] or whole, count)
        return plans

    def _backward(
        self, batch: Batch, mini: int, generator: torch.Generator, pending: Pending,
        sums: _MetricSums, cancellable: bool,
    ) -> None:  # fmt: skip
        micros = self.trainer.micro_batches(batch)
        total = 0.0
        for micro in range(micros):
            chunks = pending.plans.get((mini, micro))
            shares: dict[str, float] = defaultdict(float)
            for chunk, rows in enumerate(chunks or [None]):
                if cancellable:
                    cancel_point()
                part = Part(
                    mini, self.mini_batches, micro, micros, generator, self.version,
                    chunk, len(chunks or [None]), rows,
                )  # fmt: skip
                loss, metrics = self.trainer.loss(batch, part)
                torch.autograd.backward(loss if self.window == 1 else loss / self.window)
                self._tokens += pending.tokens(part)
                total += float(loss.detach())
                if chunks is None:  # whole: as returned
                    shares = dict(metrics)
                else:  # a chunk's values are its shares of the micro-batch's
                    for key, value in metrics.items():
                        shares[key] += float(value)
            sums.add(shares)
        sums.loss(total)

    def _zero_grad(self) -> None:
        for spec in self.optimizers:
            spec.optimizer.zero_grad(set_to_none=True)

    def _step(self, sums: _MetricSums) -> None:
        """Set the scheduled rate, clip each optimizer's gradients, step it; the norms
        before clipping (and the rate) go to ``sums``."""
        if self.world.parallel:  # every rank steps on the mean of the ranks' gradients
            params = [p for spec in self.optimizers for p in spec.params]
            # Sharded (FSDP2) parameters came averaged out of backward; the rest by hand.
            distributed.average_gradients([p for p in params if not parallel.is_dtensor(p)])
        if self.schedule != "constant":
            factor = lr_factor(
                self.schedule, self.version, self.updates, warmup=self.warmup, final=self.final
            )
            sums.add({"lr": apply_factor(self.optimizers, factor)})
        norms = {}
        for spec in self.optimizers:
            limit = spec.grad_clip if spec.grad_clip > 0 else float("inf")
            norms[spec.name] = parallel.clip_grad_norm(spec.params, limit)
            spec.optimizer.step()
        sums.norms(norms)


# A batch's chunks by (mini-batch, micro-batch); a part that fits whole is absent.
Plans = dict[tuple[int, int], Chunks]


@dataclass(frozen=True)
class Pending:
    """How a batch of the window is split, and its rows' lengths (None: not reported)."""

    plans: Plans
    lengths: Sequence[int] | None

    def tokens(self, part: Part) -> float:
        """What a loss call computed, for perf/mfu: its rows x its longest row (0 when
        the lengths are not reported)."""
        if self.lengths is None:
            return 0.0
        rows = part.rows(len(self.lengths))
        picked = self.lengths[rows] if isinstance(rows, slice) else [
            self.lengths[r] for r in rows.tolist()
        ]  # fmt: skip
        return float(len(picked) * max(picked, default=0))


def _norm_key(optimizer: str) -> str:
    """``grad_norm`` for the default optimizer name, ``<name>/grad_norm`` otherwise."""
    return "grad_norm" if optimizer == DEFAULT_OPTIMIZER else f"{optimizer}/grad_norm"


class _MetricSums:
    """Running sums of one ``train`` call's metrics, and their means."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._sums[key] += float(value)
            self._counts[key] += 1

    def loss(self, value: float) -> None:
        self.add({"loss": value})

    def norms(self, norms: Mapping[str, float]) -> None:
        self.add({_norm_key(name): value for name, value in norms.items()})

    def means(self) -> dict[str, float]:
        return {f"train/{key}": total / self._counts[key] for key, total in self._sums.items()}
