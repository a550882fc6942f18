"""On-policy distillation of a Hugging Face policy (registered as ``hf_distill``): the
student (``trainer.model``, warm-started by ``init_from``) answers the prompts on its
rollout engine, as ``hf_grpo`` does; a teacher (``trainer.teacher``, its weights from
``trainer.teacher_from``) scores every sampled token on an engine of its own
(``trainer.teacher_engine``), and the student is trained on the per-token reverse KL
to it (trainers/lm/distill.py: exact, from the teacher's whole log-prob rows, or as
each sampled token's advantage), optionally plus the task reward's.

The teacher's scoring is part of each rollout, so in an async run (loop.concurrency >
1) one batch's scoring overlaps another's generation: the teacher's local engine has a
lane of its own then, as the student's does. Teacher and student must share a
tokenizer (the teacher scores the student's token ids): checked at start. The teacher
never changes; a checkpoint holds the student only (a resume loads the teacher again).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from corun import ConfigError, RolloutContext, SetupContext
from corun.contract.engine import ScoringEngine
from corun.engines.options import EngineOptions
from corun.engines.start import EngineKind, check_engine, start_engine
from trainers.hf.policy import HFPolicy
from trainers.hf.rl import HFPrompts, HFSettings, check_hf_config, sync
from trainers.hf.state import load_model
from trainers.lm.distill import Distill, DistillConfig
from trainers.lm.policy_gradient import Scored
from trainers.lm.settings import with_settings
from trainers.weights import warm_start_runs

TEACHER_OPTIONS = "trainer.teacher_engine_options"


class HFDistillSettings(HFSettings, frozen=True, kw_only=True):
    """The teacher, besides the student's settings (``hf_grpo``'s)."""

    teacher: str  # "hf:<dir>" or a built-in model: the teacher's architecture and tokenizer
    # Its weights: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: the directory's own.
    teacher_from: str = ""
    teacher_engine: EngineKind = "local"
    teacher_engine_options: EngineOptions = EngineOptions()  # [trainer.teacher_engine_options]


def check_distill_config(config: Any) -> None:
    check_hf_config(config)
    check_engine(config.teacher_engine, config.teacher_engine_options, False, TEACHER_OPTIONS)
    if config.teacher_engine == "vllm-server":
        raise ValueError(
            '`$.teacher_engine` = "vllm-server": a vLLM server does not score tokens yet; '
            'use "local", "vllm" (in process) or "remote" (a fleet of local engines)'
        )
    if config.teacher_engine == "vllm" == config.engine:
        raise ValueError(
            '`$.teacher_engine` = "vllm": the student\'s engine is in-process vLLM too, and a '
            'process holds one; put the student on "local" or "vllm-server"'
        )
    if config.distill_kl == "exact" and config.teacher_engine != "local":
        raise ValueError(
            f'`$.distill_kl` = "exact": the {config.teacher_engine!r} teacher engine returns '
            'the sampled tokens\' scores only, not whole rows; use teacher_engine = "local" '
            'or distill_kl = "sampled"'
        )


HFDistillConfig = with_settings("HFDistillConfig", DistillConfig, HFDistillSettings,
                                check_distill_config)  # fmt: skip


class HFDistillTrainer(HFPrompts):
    Config = HFDistillConfig
    Algorithm = Distill
    teacher: ScoringEngine

    def prerequisites(self) -> list[str]:
        return warm_start_runs(self.config.init_from, self.config.teacher_from)

    async def setup(self, ctx: SetupContext) -> None:
        await super().setup(ctx)
        cfg = self.config
        teacher = await sync.on_lane(ctx.lane, self.load_teacher)
        started = await start_engine(
            cfg.teacher_engine, cfg.teacher_engine_options, teacher, self.chat.pad_id, ctx,
            interrupt=False, role="teacher", where=TEACHER_OPTIONS,
        )  # fmt: skip
        assert isinstance(started, ScoringEngine)  # bounded: it passes scoring on
        self.teacher = started

    def load_teacher(self) -> HFPolicy:
        """The teacher's model, refused (one line) if its tokenizer is not the student's."""
        cfg = self.config
        teacher, tokenizer = load_model(cfg.teacher, cfg.teacher_from, "`$.trainer.teacher`",
                                        self.device)  # fmt: skip
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(
                f"`$.trainer.teacher` = {cfg.teacher!r}: its tokenizer is not the student's "
                f"({cfg.model!r}); the teacher scores the student's tokens, so they must share one"
            )
        return teacher

    async def annotate(
        self, scored: Scored, ctx: RolloutContext
    ) -> tuple[Scored, dict[str, float]]:
        """The teacher's log-probs of the sampled tokens, and how far the student is."""
        rollouts = scored.rollouts
        prompt_mask = rollouts.prompt_mask
        if prompt_mask is None:  # prompts of one length
            prompt_mask = torch.ones_like(rollouts.prompt_ids, dtype=torch.bool)
        prompts = real_rows(rollouts.prompt_ids, prompt_mask)
        replies = real_rows(rollouts.response_ids, rollouts.response_mask)
        started = time.monotonic()
        teacher = torch.zeros_like(rollouts.logprobs)
        with ctx.span("teacher", ctx.track, rows=len(prompts)):
            if self.config.distill_kl == "exact":
                rows = await self.teacher.distributions(prompts, replies)
                # (N, T, vocab): built off the event loop, as the batch's other tensors.
                scored.teacher_rows, teacher = await ctx.compute(
                    lambda: teacher_rows(rows, rollouts.response_ids)
                )
            else:
                scores = await self.teacher.score(prompts, replies)
                for row, values in enumerate(scores):
                    teacher[row, : len(values)] = torch.tensor(values)
        mask = rollouts.response_mask
        teacher = teacher * mask
        tokens = max(1, int(mask.sum()))
        gap = ((rollouts.logprobs - teacher) * mask).sum() / tokens
        metrics = {
            "distill/reverse_kl": float(gap),  # per token, on the student's samples
            "distill/teacher_logp": float((teacher * mask).sum() / tokens),
            "perf/teacher_time_s": time.monotonic() - started,
        }
        scored.teacher_logprobs = teacher
        return scored, metrics


def real_rows(ids: Tensor, real: Tensor) -> list[list[int]]:
    """Each row's tokens where ``real`` is set (its padding dropped)."""
    return [row[keep].tolist() for row, keep in zip(ids, real, strict=True)]


def teacher_rows(rows: list[Tensor], replies: Tensor) -> tuple[Tensor, Tensor]:
    """Each reply's log-prob rows in one (N, T, vocab) tensor, 0 past each reply, and
    the entries of its tokens (``replies``: (N, T), padded)."""
    vocab = max((row.shape[-1] for row in rows), default=1)
    out = torch.zeros(*replies.shape, vocab)
    for index, row in enumerate(rows):
        out[index, : row.shape[0], : row.shape[-1]] = row
    chosen = out.gather(-1, replies.clamp(max=vocab - 1)[..., None])[..., 0]
    return out, chosen
