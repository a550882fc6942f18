"""A complete trainer of a new algorithm: a leave-one-out policy gradient (RLOO).

Each prompt gets k sampled answers; an answer's advantage is its reward minus the mean
reward of the other k - 1, and the loss is -advantage x the answer's log-prob. The
task, the TinyLM policy, sampling, log-probs and the held-out evaluation are corun's
built-in pieces (trainers/lm/). Run it: PYTHONPATH=. corun train examples/loo.toml
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import torch

import corun
from trainers.lm.model import decode
from trainers.lm.policy import (
    HeldOutEval,
    build_policy,
    load_policy_state,
    policy_from,
    policy_state,
    response_logprobs,
)
from trainers.lm.tasks import EOS, TASKS, TaskData, decode_responses, encode_prompts
from trainers.weights import warm_start_runs


class LOOConfig(corun.TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[trainer]`` table (``kind`` comes from corun.TrainerConfig)."""

    task: Literal["sort", "addition", "reverse"] = "sort"
    init_from: str = ""  # a checkpoint folder or a run's .toml (trained first); "": fresh
    samples: Annotated[int, msgspec.Meta(ge=2)] = 4  # k answers per prompt
    lr: float = 3e-4
    eval_size: int = 512  # held-out prompts per evaluation


class LOOTrainer(corun.Trainer[LOOConfig]):
    Config = LOOConfig  # [trainer] decoded into it is self.config; the whole run's self.run_config

    def prerequisites(self) -> list[str]:  # a warm start's run is trained first when missing
        return warm_start_runs(self.config.init_from)

    def setup(self, ctx: corun.SetupContext) -> None:
        if ctx.config.loop.concurrency > 1:  # rollouts read the live weights (no sync_weights)
            raise corun.ConfigError("`$.loop.concurrency`: the LOO example samples at 1 only")
        cfg, self.device = self.config, ctx.device
        self.task = TASKS[cfg.task]
        policy = policy_from(cfg.init_from) if cfg.init_from else build_policy(128, 2, 4)
        self.policy = policy.to(self.device)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr)
        ctx.add_optimizer(self.optimizer, grad_clip=1.0)  # the runtime zeroes, clips, steps
        self.held_out = HeldOutEval(self.task, cfg.eval_size, self.device)

    def dataset(self) -> corun.Dataset:  # batch i: batch_size (prompt, answer) pairs
        return TaskData(self.task, self.run_config.data.batch_size, self.run_config.run.seed)

    @torch.no_grad()
    def rollout(self, examples: list[tuple[str, str]], ctx: corun.RolloutContext) -> corun.Batch:
        k = self.config.samples
        prompts = encode_prompts([p for p, _ in examples]).repeat_interleave(k, dim=0)
        self.policy.eval()
        out = decode(self.policy, prompts.to(self.device), self.task.max_answer_len + 1,
                     stop_id=EOS, temperature=1.0, generator=ctx.generator)  # fmt: skip
        samples = [example for example in examples for _ in range(k)]
        scored = zip(samples, decode_responses(out.tokens), strict=True)
        rewards = torch.tensor([self.task.reward(p, a, response) for (p, a), response in scored])
        groups = rewards.view(-1, k)
        others = (groups.sum(dim=1, keepdim=True) - groups) / (k - 1)  # the leave-one-out mean
        eos = out.tokens == EOS
        data = {
            "sequences": torch.cat([prompts.to(self.device), out.tokens], dim=1),
            "prompt_len": prompts.shape[1],
            "mask": (eos.cumsum(dim=1) - eos.long()) == 0,  # answer tokens up to the EOS
            "advantages": (groups - others).flatten().to(self.device),
        }
        metrics = {"rollout/reward_mean": float(rewards.mean()),
                   "rollout/exact_match": float((rewards == 1).float().mean())}  # fmt: skip
        return corun.Batch(data, metrics=metrics)

    def loss(self, batch: corun.Batch, part: corun.Part) -> tuple[torch.Tensor, dict[str, float]]:
        data, n = batch.data, len(batch.data["advantages"])
        seqs, mask, adv = (data[key][part.rows(n)] for key in ("sequences", "mask", "advantages"))
        self.policy.train()
        logp, _, _ = response_logprobs(self.policy, seqs, data["prompt_len"], temperature=1.0)
        answer_logp = (logp * mask).sum(dim=1)
        loss = -(adv * answer_logp).mean() * part.share(n)  # the micro-batch's share of the mean
        return loss, {"answer_logp": float(answer_logp.detach().mean())}  # train/answer_logp

    def evaluate(self) -> dict[str, float]:  # greedy: eval/accuracy (exact match), eval/reward
        return self.held_out(self.policy)

    def state_dict(self) -> dict[str, Any]:  # checkpoints; a later run's init_from reads them
        return policy_state(self.policy, self.optimizer, self.config.task)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(state, self.policy, self.optimizer, self.config.task)
