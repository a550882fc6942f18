"""The job of ``corun bench longtail``: the ``hf_grpo`` recipe with long-tailed
generation lengths, loaded by ``corun train`` as ``trainer.kind =
"benchmarks.longtail_job:LongTailGRPO"`` (the suite runs it as processes, never
imports it).

Reasoning rollouts are long-tailed: most end soon, a few run 10–50 times longer. Here
every sampled row generates a drawn number of tokens past its answer — ``base``
(``trainer.max_new_tokens``) times a Pareto multiplier (shape ``TAIL_SHAPE``, capped at
``TAIL_CAP``), the end-of-sequence id ignored — and is then cut back to what the recipe
would have kept (up to its first end-of-sequence id, at most ``base`` tokens). The
policy, reward and update are the recipe's; only the generation's length, and so its
cost, has the tail. Greedy evaluation is untouched.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import anyio

from corun.contract.engine import Engine, EngineWrapper, Generation, Sampling
from trainers.hf.rl import HFGRPOTrainer

TAIL_SHAPE = 1.2  # P(multiplier > x) = x^-1.2: ~6 % of rows past 10x
TAIL_CAP = 25  # the tiny model's 256 positions: 8 new tokens x 25 = 200, past a prompt


def tail_lengths(count: int, base: int, seed: int) -> list[int]:
    """``count`` generation lengths: ``base`` times a capped Pareto draw."""
    draw = random.Random(seed)
    return [base * min(TAIL_CAP, int(draw.paretovariate(TAIL_SHAPE))) for _ in range(count)]


class LongTailEngine(EngineWrapper):
    """The run's engine, every sampled row generating its drawn length (see above)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.generated = 0  # tokens generated for training rows, over the run

    def metrics(self) -> dict[str, float]:
        return {"longtail/generated_tokens_total": float(self.generated)}

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        if sampling.temperature == 0:  # evaluation: as the recipe
            return await self.inner.generate(prompts, sampling, seed)
        lengths = tail_lengths(len(prompts), sampling.max_tokens, seed)
        found: list[Generation | None] = [None] * len(prompts)

        async def one_length(length: int) -> None:  # rows of a length share a call
            rows = [i for i, n in enumerate(lengths) if n == length]
            long = replace(sampling, max_tokens=length, stop_ids=())
            got = await self.inner.generate([prompts[i] for i in rows], long, seed + length)
            for i, generation in zip(rows, got, strict=True):
                found[i] = generation

        async with anyio.create_task_group() as calls:
            for length in sorted(set(lengths)):
                calls.start_soon(one_length, length)
        done = [g for g in found if g is not None]
        self.generated += sum(len(g.ids) for g in done)
        return [cut(g, sampling) for g in done]


def cut(generation: Generation, sampling: Sampling) -> Generation:
    """What the recipe's sampling would have kept: up to the first stop id, at most
    ``sampling.max_tokens`` tokens."""
    ids = generation.ids[: sampling.max_tokens]
    end = next((i + 1 for i, t in enumerate(ids) if t in sampling.stop_ids), None)
    keep = len(ids) if end is None else end
    return Generation(
        generation.ids[:keep], generation.logprobs[:keep], generation.versions[:keep],
        "stop" if end is not None else "length",
    )  # fmt: skip


class LongTailGRPO(HFGRPOTrainer):
    """``hf_grpo`` with long-tailed generation (the module's docstring)."""

    async def wrap_engine(self, engine: Engine) -> Engine:
        return LongTailEngine(await super().wrap_engine(engine))
